// A stand-in megatraind for the CLI's tests: gRPC services of the test's own on a Unix
// socket of this process, a client Context pointed at it, and each command's output
// captured.
#pragma once

#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <functional>
#include <initializer_list>
#include <memory>
#include <string>

#include "client/context.h"
#include "gtest/gtest.h"

namespace megatrain::client {

class FakeDaemonTest : public ::testing::Test {
 protected:
  // Serves `services` on /tmp/<name>-<pid>.sock; ctx_ talks to it (tables, as alice).
  void Serve(const std::string& name, std::initializer_list<grpc::Service*> services) {
    socket_ = "/tmp/" + name + "-" + std::to_string(::getpid()) + ".sock";
    ::unlink(socket_.c_str());
    grpc::ServerBuilder builder;
    builder.AddListeningPort("unix:" + socket_, grpc::InsecureServerCredentials());
    for (grpc::Service* service : services) builder.RegisterService(service);
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    ctx_ = MakeContext("unix:" + socket_, Output::kTable, "alice", 10, false);
  }
  // The server goes before the subclass's services, which it serves.
  void TearDown() override {
    if (server_ != nullptr) server_->Shutdown();
    server_.reset();
    ::unlink(socket_.c_str());
  }

  // Runs a command with stdout and stderr captured; returns its exit code.
  int Capture(const std::function<int()>& command) {
    ::testing::internal::CaptureStdout();
    ::testing::internal::CaptureStderr();
    const int rc = command();
    out_ = ::testing::internal::GetCapturedStdout();
    err_ = ::testing::internal::GetCapturedStderr();
    return rc;
  }

  std::string socket_;
  std::unique_ptr<grpc::Server> server_;
  Context ctx_;
  std::string out_, err_;
};

}  // namespace megatrain::client
