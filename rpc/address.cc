// The address rule of address.h. Only DefaultAddress() looks at the file system;
// DefaultAddressFor() is the pure rule.
#include "rpc/address.h"

#include <sys/stat.h>
#include <unistd.h>

namespace megatrain {

std::string DefaultAddressFor(uid_t euid, bool system_socket_exists) {
  if (euid == 0 || system_socket_exists) return std::string("unix:") + kSystemSocketPath;
  return "unix:/tmp/megatrain-" + std::to_string(euid) + "/megatrain.sock";
}

std::string DefaultAddress() {
  struct stat st;
  const bool system_socket_exists = ::stat(kSystemSocketPath, &st) == 0;
  return DefaultAddressFor(::geteuid(), system_socket_exists);
}

std::string ResolveAddress(const std::string& flag, const std::string& env) {
  if (!flag.empty()) return flag;
  if (!env.empty()) return env;
  return DefaultAddress();
}

std::optional<std::string> UnixSocketPath(const std::string& address) {
  constexpr char kScheme[] = "unix:";
  constexpr size_t kSchemeLen = sizeof(kScheme) - 1;
  if (address.compare(0, kSchemeLen, kScheme) != 0) return std::nullopt;
  std::string rest = address.substr(kSchemeLen);
  // "unix:///path" is the URI form with an empty authority; "unix:/path" the short form.
  if (rest.compare(0, 2, "//") == 0) rest = rest.substr(2);
  if (rest.empty()) return std::nullopt;
  return rest;
}

}  // namespace megatrain
