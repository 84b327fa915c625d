// Channel setup, per-call metadata and deadlines, and the error reporting every command
// ends with. The "cannot reach" case gets its own message because it is by far the most
// common failure and gRPC's own text ("failed to connect to all addresses") does not say
// what to do.
#include "client/context.h"

#include <pwd.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <cstdio>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/exit_codes.h"
#include "client/format.h"
#include "google/protobuf/util/json_util.h"

namespace megatrain::client {
namespace {

std::chrono::system_clock::time_point DeadlineAfter(double seconds) {
  return std::chrono::system_clock::now() +
         std::chrono::duration_cast<std::chrono::system_clock::duration>(
             std::chrono::duration<double>(seconds));
}

std::string CodeName(grpc::StatusCode code) {
  // gRPC's codes are absl's, number for number.
  return absl::StatusCodeToString(static_cast<absl::StatusCode>(code));
}

// gRPC's own text for a reply over the client's limit (4 MiB): "Received message larger
// than max (6291461 vs. 4194304)".
constexpr char kReplyTooLarge[] = "Received message larger than max";

// A reply over the limit can only come from a daemon that does not bound its replies:
// one older than this CLI, with a job stored with an oversized field.
int ReportReplyTooLarge(const Context& ctx, const std::string& detail) {
  unsigned long long received_bytes = 0;
  long long max_bytes = 0;
  std::string size;
  if (std::sscanf(detail.c_str(), "Received message larger than max (%llu vs. %lld)",
                  &received_bytes, &max_bytes) == 2) {
    size = absl::StrFormat(" (%.1f MiB; this CLI accepts %.1f MiB)", received_bytes / 1048576.0,
                           max_bytes / 1048576.0);
  }
  std::fprintf(stderr,
               "error: the reply of megatraind at %s is too large to receive%s: it holds a job "
               "or log line stored with an oversized field (a name of megabytes?), and this "
               "megatraind is older than the CLI: newer ones cut such fields in their replies; "
               "upgrade megatraind, or ask for less (e.g. `megatrain list --limit 10`)\n",
               ctx.address.c_str(), size.c_str());
  return kExitInternal;
}

int ReportUnreachable(const Context& ctx, const std::string& detail) {
  std::fprintf(stderr,
               "error: cannot reach megatraind at %s: is it running? (set --addr or "
               "MEGATRAIN_ADDR)\n",
               ctx.address.c_str());
  if (!detail.empty()) std::fprintf(stderr, "  (%s)\n", TerminalText(detail).c_str());
  if (detail.find("certificate verify failed") != std::string::npos) {
    std::fprintf(stderr, "  the daemon's TLS certificate is not signed by a CA this CLI trusts: "
                         "pass its CA with --tls-ca or MEGATRAIN_TLS_CA\n");
  }
  return kExitUnreachable;
}

}  // namespace

Context MakeContext(const std::string& address, Output output, std::string user, double timeout_s,
                    bool timeout_given, const Security& security) {
  Context ctx;
  ctx.address = address;
  grpc::ChannelArguments args;
  args.SetUserAgentPrefix("megatrain-cli/" MEGATRAIN_VERSION);
  std::shared_ptr<grpc::ChannelCredentials> credentials;
  if (address.rfind("unix:", 0) == 0) {
    credentials = grpc::InsecureChannelCredentials();
  } else {
    grpc::SslCredentialsOptions tls;
    tls.pem_root_certs = security.ca_pem;
    credentials = grpc::SslCredentials(tls);
    ctx.token = security.token;
  }
  ctx.channel = grpc::CreateCustomChannel(address, credentials, args);
  ctx.jobs = v1::JobService::NewStub(ctx.channel);
  ctx.node = v1::NodeService::NewStub(ctx.channel);
  ctx.access = v1::AccessService::NewStub(ctx.channel);
  ctx.output = output;
  ctx.user = std::move(user);
  ctx.timeout_s = timeout_s;
  ctx.timeout_given = timeout_given;
  return ctx;
}

std::string CurrentUser() {
  const uid_t uid = ::geteuid();
  const struct passwd* pw = ::getpwuid(uid);
  if (pw != nullptr && pw->pw_name != nullptr && pw->pw_name[0] != '\0') return pw->pw_name;
  return std::to_string(uid);
}

absl::StatusOr<std::string> ResolveToken(const std::string& file, const std::string& env_token,
                                         const std::string& home) {
  auto first_line = [](std::istream& in) {
    std::string line;
    std::getline(in, line);
    while (!line.empty() && (line.back() == '\r' || line.back() == ' ')) line.pop_back();
    return line;
  };
  if (!file.empty()) {
    std::ifstream in(file);
    if (!in) return absl::NotFoundError(absl::StrCat("cannot read the token file ", file));
    return first_line(in);
  }
  if (!env_token.empty()) return env_token;
  if (!home.empty()) {
    std::ifstream in(absl::StrCat(home, "/.config/megatrain/token"));
    if (in) return first_line(in);
  }
  return std::string();
}

std::unique_ptr<grpc::ClientContext> NewCall(const Context& ctx, CallKind kind) {
  auto call = std::make_unique<grpc::ClientContext>();
  if (!ctx.token.empty()) call->AddMetadata("authorization", "Bearer " + ctx.token);
  if (kind == CallKind::kReply || (kind == CallKind::kLong && ctx.timeout_given)) {
    call->set_deadline(DeadlineAfter(ctx.timeout_s));
  }
  return call;
}

bool WaitForConnection(const Context& ctx) {
  const auto deadline = DeadlineAfter(ctx.timeout_s);
  grpc_connectivity_state state = ctx.channel->GetState(/*try_to_connect=*/true);
  while (state != GRPC_CHANNEL_READY) {
    if (state == GRPC_CHANNEL_TRANSIENT_FAILURE || state == GRPC_CHANNEL_SHUTDOWN) return true;
    if (!ctx.channel->WaitForStateChange(state, deadline)) {
      ReportUnreachable(ctx, absl::StrCat("still connecting after ", ctx.timeout_s,
                                          " s; raise --timeout if the network is slow"));
      return false;
    }
    state = ctx.channel->GetState(/*try_to_connect=*/true);
  }
  return true;
}

int ReportRpcError(const Context& ctx, const grpc::Status& status) {
  const grpc::StatusCode code = status.error_code();
  const std::string& message = status.error_message();
  if (code == grpc::StatusCode::UNAVAILABLE) return ReportUnreachable(ctx, message);
  if (code == grpc::StatusCode::DEADLINE_EXCEEDED) {
    // Only a channel that connected has a daemon that was too slow; otherwise the
    // deadline ran out while connecting.
    if (ctx.channel->GetState(false) != GRPC_CHANNEL_READY) {
      return ReportUnreachable(ctx, message);
    }
    std::fprintf(stderr,
                 "error: megatraind at %s did not answer within %g s; it may be busy: retry, "
                 "or raise --timeout\n",
                 ctx.address.c_str(), ctx.timeout_s);
    return kExitInternal;
  }
  if (code == grpc::StatusCode::RESOURCE_EXHAUSTED && message.rfind(kReplyTooLarge, 0) == 0) {
    return ReportReplyTooLarge(ctx, message);
  }
  if (code == grpc::StatusCode::UNIMPLEMENTED && message.empty()) {
    std::fprintf(stderr,
                 "error: megatraind at %s does not implement this call; it may be older than "
                 "this CLI (`megatrain node` shows its version)\n",
                 ctx.address.c_str());
    return kExitInternal;
  }
  if (message.empty()) {
    std::fprintf(stderr, "error: megatraind failed with %s and no message; see its log\n",
                 CodeName(code).c_str());
  } else {
    // The daemon's message can quote a job's name or a path: one line, escaped.
    std::fprintf(stderr, "error: %s\n", TerminalText(message).c_str());
  }
  return ExitCodeFor(code);
}

bool PrintJson(const google::protobuf::Message& message) {
  google::protobuf::util::JsonPrintOptions options;
  options.preserve_proto_field_names = true;
  options.always_print_primitive_fields = true;
  std::string json;
  const auto status = google::protobuf::util::MessageToJsonString(message, &json, options);
  if (!status.ok()) {
    std::fprintf(stderr, "error: cannot print the reply as JSON: %s\n", status.ToString().c_str());
    return false;
  }
  json += '\n';
  std::fwrite(json.data(), 1, json.size(), stdout);
  std::fflush(stdout);
  return true;
}

void PrintLine(const std::string& text) {
  std::fwrite(text.data(), 1, text.size(), stdout);
  if (text.empty() || text.back() != '\n') std::fputc('\n', stdout);
}

}  // namespace megatrain::client
