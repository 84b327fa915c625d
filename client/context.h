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

#include "google/protobuf/message.h"
#include "megatrain/v1/jobs.grpc.pb.h"
#include "megatrain/v1/node.grpc.pb.h"

namespace megatrain::client {

// The metadata key that carries the caller's login name on every call.
inline constexpr char kUserMetadataKey[] = "x-megatrain-user";

enum class Output { kTable, kJson };

// Built once in main() from the global flags; commands only read it. Not thread-safe.
struct Context {
  std::string address;  // as given to gRPC, for messages
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::JobService::Stub> jobs;
  std::unique_ptr<v1::NodeService::Stub> node;
  Output output = Output::kTable;
  std::string user;            // sent as kUserMetadataKey
  double timeout_s = 30;       // --timeout
  bool timeout_given = false;  // --timeout was on the command line
};

// A Context with an (insecure) channel to `address`. Nothing connects until the first call.
Context MakeContext(const std::string& address, Output output, std::string user, double timeout_s,
                    bool timeout_given);

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

// Prints "error: ..." for a failed call to stderr and returns the exit code for it.
int ReportRpcError(const Context& ctx, const grpc::Status& status);

// Prints `message` as one line of protobuf JSON (proto field names, zero values included)
// and flushes stdout. Returns false, after printing an error, if conversion fails.
[[nodiscard]] bool PrintJson(const google::protobuf::Message& message);

// Prints `text` to stdout, adding a newline if it has none.
void PrintLine(const std::string& text);

}  // namespace megatrain::client
