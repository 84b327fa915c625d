// What every command shares: the channel and stubs, the output mode, the caller's name,
// and the rules for deadlines, errors and JSON output.
//
// Deadlines: a plain request waits --timeout (default 30 s) for its reply. Calls that
// legitimately take long (a checkpoint of a big model, holding a running job) and streams
// have no deadline; for those, WaitForConnection() bounds only the connect by --timeout,
// so an unreachable daemon is still reported promptly.
#pragma once

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>

#include "absl/status/statusor.h"

#include "google/protobuf/message.h"
#include "megatrain/v1/jobs.grpc.pb.h"
#include "megatrain/v1/access.grpc.pb.h"
#include "megatrain/v1/node.grpc.pb.h"

namespace megatrain::client {

// Environment variables (main reads them): a token for TCP addresses, and the CA that
// signed the daemon's TLS certificate (else the system's roots).
inline constexpr char kTokenEnvVar[] = "MEGATRAIN_TOKEN";
inline constexpr char kTlsCaEnvVar[] = "MEGATRAIN_TLS_CA";

enum class Output { kTable, kJson };

// Built once in main() from the global flags; commands only read it. Not thread-safe.
struct Context {
  std::string address;  // as given to gRPC, for messages
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::JobService::Stub> jobs;
  std::unique_ptr<v1::NodeService::Stub> node;
  std::unique_ptr<v1::AccessService::Stub> access;
  Output output = Output::kTable;
  std::string user;            // this process's login name (for --mine)
  std::string token;           // sent as "authorization: Bearer" (TCP addresses)
  double timeout_s = 30;       // --timeout
  bool timeout_given = false;  // --timeout was on the command line
};

// How to reach a TCP address: TLS always, with a token.
struct Security {
  std::string token;   // "" for Unix sockets (the kernel names the caller there)
  std::string ca_pem;  // the CA that signed the daemon's certificate; "" = system roots
};

// A Context with a channel to `address`: plain for "unix:" (the daemon reads the peer's
// uid), TLS for anything else. Nothing connects until the first call.
Context MakeContext(const std::string& address, Output output, std::string user, double timeout_s,
                    bool timeout_given, const Security& security = {});

// The token for TCP calls: `file`'s first line if given, else `env_token` (the value of
// $MEGATRAIN_TOKEN, as main read it), else <home>/.config/megatrain/token's first line if
// it exists (`home`: $HOME; "" when unset), else "". An unreadable `file` is an error.
absl::StatusOr<std::string> ResolveToken(const std::string& file, const std::string& env_token,
                                         const std::string& home);

// The login name of the effective uid (getpwuid), or the uid in digits if it has none.
std::string CurrentUser();

enum class CallKind {
  kReply,   // deadline --timeout
  kLong,    // no deadline unless --timeout was given
  kStream,  // no deadline
};

// A ClientContext with the user metadata and the deadline of `kind`.
std::unique_ptr<grpc::ClientContext> NewCall(const Context& ctx, CallKind kind);

// For kLong and kStream calls: waits up to --timeout for the channel to connect or fail.
// Returns false, after printing the "cannot reach" error, if it is still connecting then;
// a failed connect returns true and leaves the report to the call's UNAVAILABLE status.
[[nodiscard]] bool WaitForConnection(const Context& ctx);

// Prints "error: ..." for a failed call to stderr (the daemon's message on one line,
// escaped) and returns the exit code for it. A reply over gRPC's 4 MiB limit, which only a
// daemon older than this CLI sends, is said as such and exits 1 (internal), not 6.
int ReportRpcError(const Context& ctx, const grpc::Status& status);

// Prints `message` as one line of protobuf JSON (proto field names, zero values included)
// and flushes stdout. Returns false, after printing an error, if conversion fails.
[[nodiscard]] bool PrintJson(const google::protobuf::Message& message);

// Prints `text` to stdout, adding a newline if it has none.
void PrintLine(const std::string& text);

}  // namespace megatrain::client
