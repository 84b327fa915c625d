// Where megatraind listens: one rule shared by the daemon and the CLI, so that both agree
// with no configuration.
//
// A system daemon (run as root) listens on /run/megatrain/megatrain.sock; a user runs a
// private daemon on /tmp/megatrain-<uid>/megatrain.sock. A user's CLI prefers the system
// socket when it exists, since that is the daemon a lab machine is set up with.
//
// Addresses are gRPC target strings: "unix:/path", "unix:///path" or "host:port".
#pragma once

#include <sys/types.h>

#include <optional>
#include <string>

namespace megatrain {

// The system daemon's socket path.
inline constexpr char kSystemSocketPath[] = "/run/megatrain/megatrain.sock";

// The environment variable that overrides the default address (main() reads it).
inline constexpr char kAddressEnvVar[] = "MEGATRAIN_ADDR";

// The address to use with no configuration, for this process's effective uid:
//   root                                  -> "unix:/run/megatrain/megatrain.sock"
//   /run/megatrain/megatrain.sock exists  -> "unix:/run/megatrain/megatrain.sock"
//   otherwise                             -> "unix:/tmp/megatrain-<uid>/megatrain.sock"
std::string DefaultAddress();

// The rule behind DefaultAddress(), with its inputs made explicit (for tests).
std::string DefaultAddressFor(uid_t euid, bool system_socket_exists);

// `flag` if non-empty, else `env` (the value of $MEGATRAIN_ADDR, "" when unset) if
// non-empty, else DefaultAddress(). Call it once, in main.
std::string ResolveAddress(const std::string& flag, const std::string& env);

// The socket path of a "unix:/path" or "unix:///path" address; nullopt for other schemes.
// The daemon uses it to create the socket's folder and remove a stale socket.
std::optional<std::string> UnixSocketPath(const std::string& address);

}  // namespace megatrain
