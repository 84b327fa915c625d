// megatrain: the command-line client of megatraind.
//
// Defines the command line with CLI11, builds the Context from the global options and
// runs one subcommand (commands.h). CLI11 reports bad usage by throwing; those exceptions
// are caught here, the only place in the client that sees any, and become exit code 2.
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "client/commands.h"
#include "client/context.h"
#include "client/exit_codes.h"
#include "client/format.h"
#include "rpc/address.h"

namespace megatrain::client {
namespace {

// Everything the command line sets.
struct CommandLine {
  std::string addr;
  std::string output = "table";
  double timeout_s = 30;
  bool timeout_given = false;
  std::string command;  // the subcommand's name
  SubmitArgs submit;
  ListArgs list;
  int64_t job_id = 0;
  bool follow = false;
  std::string plan_spec_path;
  std::string token_file;
  std::string tls_ca;
  TokenArgs token;
  AuditArgs audit;
  GenerateArgs generate;  // generate and eval
  std::vector<std::string> merge;  // BASE ADAPTER OUT
};

// What the environment says, read once in main(): "" for a variable unset.
struct Environment {
  std::string addr;    // $MEGATRAIN_ADDR
  std::string token;   // $MEGATRAIN_TOKEN
  std::string tls_ca;  // $MEGATRAIN_TLS_CA
  std::string home;    // $HOME
};

std::string Footer() {
  return std::string(kExitCodesHelp) +
         "\nThe daemon's address: --addr, else $MEGATRAIN_ADDR, else " + DefaultAddress() +
         ".\nOver a Unix socket megatraind knows you (" + CurrentUser() +
         ") from the kernel; over host:port it needs TLS and a token (--token-file, else "
         "$MEGATRAIN_TOKEN, else ~/.config/megatrain/token; create one with `megatrain token "
         "create` on the machine).\n";
}

void AddJobId(CLI::App* sub, CommandLine& cl) {
  static const CLI::Validator kJobId(
      [](std::string& s) -> std::string {
        // At most 18 digits: always fits an int64 (CLI11 would wrap a longer one).
        const bool digits =
            !s.empty() && s.size() <= 18 && s.find_first_not_of("0123456789") == std::string::npos;
        if (digits && s.find_first_not_of('0') != std::string::npos) return "";
        return "'" + s + "' is not a job id; ids are positive integers (see `megatrain list`)";
      },
      "ID");
  sub->add_option("id", cl.job_id, "the job's id (see `megatrain list`)")
      ->required()
      ->check(kJobId);
}

// The options `generate` and `eval` share, after their model and prompts: sampling, the
// output file and the job. Ranges are the daemon's to check: its message names the field.
void AddGenerationOptions(CLI::App* sub, GenerateArgs& g) {
  sub->add_option("--output-file", g.output_path,
                  "where the completions go, a JSON line each (default: completions.jsonl in "
                  "the job's folder)")
      ->type_name("FILE");
  sub->add_option("--max-new-tokens", g.max_new_tokens,
                  "tokens to generate per prompt at most (default 256)")
      ->type_name("N");
  sub->add_option("--temperature", g.temperature, "0 (the default) is greedy; higher samples")
      ->type_name("T");
  sub->add_option("--top-k", g.top_k, "sample from the K likeliest tokens only (0: all)")
      ->type_name("K");
  sub->add_option_function<double>(
         "--top-p", [&g](const double& p) { g.top_p = p; },
         "sample from the likeliest tokens that hold P of the probability, in (0, 1]")
      ->type_name("P");
  sub->add_option("--seed", g.seed, "the sampling's seed: the same seed gives the same text")
      ->type_name("S");
  sub->add_option("--stop", g.stop, "end a completion at this text (repeat for several)")
      ->type_name("TEXT");
  sub->add_option("--stop-id", g.stop_ids, "end a completion at this token id (repeat)")
      ->type_name("ID");
  sub->add_flag("--ignore-eos", g.ignore_eos, "keep generating past the end-of-sequence token");
  sub->add_flag("--chat", g.chat, "render each prompt through the model's chat template");
  sub->add_option("--tokenizer", g.tokenizer,
                  "auto (the default), byte, model, or a tokenizer.json file")
      ->type_name("NAME|FILE");
  sub->add_option("--max-sequences", g.max_sequences,
                  "prompts decoded at once (0, the default: as many as fit)")
      ->type_name("N");
  sub->add_option("--name", g.name, "the job's name (default: the command's)");
  sub->add_option("--priority", g.priority, "higher runs first; FIFO within one")
      ->capture_default_str();
  sub->add_flag("--detach", g.detach,
                "print the job and return (`megatrain status ID` shows its progress; the "
                "output file, its completions)");
}

void AddModel(CLI::App* sub, GenerateArgs& g) {
  sub->add_option("model", g.model, "the model or checkpoint folder (config.json, *.safetensors)")
      ->required()
      ->type_name("DIR");
}

void DefineGenerationCommands(CLI::App& app, CommandLine& cl) {
  // Each footer goes before the one every subcommand inherits (the global options).
  CLI::App* generate = app.add_subcommand(
      "generate",
      "complete prompts with a model on megatraind; prints each completion as it finishes "
      "(exit code as `watch`)");
  generate->footer(
      "Relative paths resolve against the current folder. Needs --prompt or --prompts. --output "
      "json prints each completion's JSON line instead of its text. Ctrl-C stops "
      "following, not the job (`megatrain cancel ID`).\n\n" +
      app.get_footer());
  AddModel(generate, cl.generate);
  generate
      ->add_option("--prompt", cl.generate.prompts,
                   "a prompt to complete (repeat for several; before the file's)")
      ->type_name("TEXT");
  generate
      ->add_option("--prompts", cl.generate.prompts_path,
                   "JSONL of prompts, a line each: {\"prompt\": text}, {\"messages\": [...]} "
                   "(with --chat) or {\"input_ids\": [...]}")
      ->type_name("FILE");
  AddGenerationOptions(generate, cl.generate);

  CLI::App* eval = app.add_subcommand(
      "eval",
      "score a model by exact match: complete each prompt, compare the answer it gives "
      "with the line's \"answer\"; prints the accuracy");
  eval->footer(
      "Relative paths resolve against the current folder. Numbers compare as numbers (1,000 = "
      "1000.0). --output json also prints each completion's JSON line. Ctrl-C stops "
      "following, not the job (`megatrain cancel ID`).\n\n" +
      app.get_footer());
  AddModel(eval, cl.generate);
  eval->add_option("--prompts", cl.generate.prompts_path,
                   "JSONL of {\"prompt\": text, \"answer\": ...} lines (\"messages\" with "
                   "--chat, or \"input_ids\", in place of \"prompt\")")
      ->required()
      ->type_name("FILE");
  eval->add_option("--answer-pattern", cl.generate.answer_pattern,
                   "regex whose last match in a completion is its answer (group 1 if it has "
                   "one; default: the completion's last number)")
      ->type_name("REGEX");
  AddGenerationOptions(eval, cl.generate);
}

// Defines the command line on `app`, binding every option into `cl`.
void DefineCommandLine(CLI::App& app, CommandLine& cl) {
  app.name("megatrain");
  app.set_version_flag("--version", "megatrain " MEGATRAIN_VERSION);
  app.require_subcommand(1);
  app.fallthrough();  // so global options may also follow the subcommand
  // Subcommands inherit the footer they are created with; the full one is set last.
  app.footer("Global options (--addr, --output, --timeout): see `megatrain --help`.");
  app.add_option("--addr", cl.addr, "megatraind's address: unix:/path, unix:///path or host:port");
  app.add_option("--token-file", cl.token_file, "file holding the token for host:port addresses");
  app.add_option("--tls-ca", cl.tls_ca,
                 "PEM CA certificate of the daemon's TLS (default $MEGATRAIN_TLS_CA, else the "
                 "system's roots)");
  app.add_option("--output,-o", cl.output, "table (for people) or json (one object per line)")
      ->check(CLI::IsMember({"table", "json"}))
      ->capture_default_str();
  app.add_option("--timeout", cl.timeout_s,
                 "seconds to wait for a reply (cancel, checkpoint, hold: no limit unless "
                 "given; watch, logs: bounds the connect only)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();

  CLI::App* submit = app.add_subcommand("submit", "submit a job spec (YAML) to the queue");
  submit
      ->add_option("spec", cl.submit.spec_path,
                   "the job spec; its relative paths resolve against its folder")
      ->required();
  submit->add_option("--priority", cl.submit.priority, "higher runs first; FIFO within one")
      ->capture_default_str();
  submit->add_flag("--hold", cl.submit.hold, "keep it out of the queue until `release`");
  submit->add_flag("--watch", cl.submit.watch, "then watch it (exit code as `watch`)");
  DefineGenerationCommands(app, cl);

  CLI::App* list = app.add_subcommand("list", "list jobs, newest first");
  list->add_option("--state", cl.list.states, "only jobs in these states (repeat, or a,b)")
      ->check(CLI::IsMember(StateNames()))
      ->delimiter(',');
  CLI::Option* owner = list->add_option("--owner", cl.list.owner, "only this user's jobs");
  list->add_flag("--mine", cl.list.mine, "only your jobs")->excludes(owner);
  list->add_option("--limit", cl.list.limit, "jobs per page (one page without --all-pages)")
      ->check(CLI::Range(1, 1000))
      ->capture_default_str();
  list->add_flag("--all-pages", cl.list.all_pages, "fetch every page");

  AddJobId(app.add_subcommand("status", "show one job in detail"), cl);
  CLI::App* watch =
      app.add_subcommand("watch",
                         "follow a job's progress until it ends; exit 0 succeeded, 10 failed, "
                         "11 cancelled");
  AddJobId(watch, cl);
  CLI::App* logs = app.add_subcommand("logs", "print a job's log");
  AddJobId(logs, cl);
  logs->add_flag("-f,--follow", cl.follow, "keep printing until the job ends");
  AddJobId(app.add_subcommand("cancel", "cancel a queued, held or running job"), cl);
  AddJobId(app.add_subcommand("checkpoint", "checkpoint a running job now; prints the path"), cl);
  AddJobId(app.add_subcommand("hold",
                              "keep a job out of the queue (a running one "
                              "checkpoints and steps aside)"),
           cl);
  AddJobId(app.add_subcommand("release", "put a held job back in the queue"), cl);
  app.add_subcommand("plan",
                     "how the daemon would run a job spec: micro-batches, activation "
                     "checkpoints, memory, predicted step time and what bounds it")
      ->add_option("spec", cl.plan_spec_path, "the job spec (YAML)")
      ->required();
  app.add_subcommand("node", "show the machine: memory, GPUs, NUMA nodes, versions");
  app.add_subcommand("whoami", "who megatraind takes you for, and whether you are an admin");
  CLI::App* token = app.add_subcommand("token", "tokens for calls over TCP (TLS)");
  token->require_subcommand(1);
  CLI::App* token_create = token->add_subcommand("create", "create a token; prints it once");
  token_create->add_option("--name", cl.token.name, "a label, e.g. laptop");
  token_create->add_option("--user", cl.token.user, "for another user (admins)");
  CLI::App* token_list = token->add_subcommand("list", "your tokens (admins: --user, or --user '*')");
  token_list->add_option("--user", cl.token.user, "another user's (admins); '*' for all");
  token->add_subcommand("revoke", "revoke a token by id")
      ->add_option("id", cl.token.id, "the token's id (see `megatrain token list`)")
      ->required();
  CLI::App* audit = app.add_subcommand("audit", "the audit log of mutating calls (admins)");
  audit->add_option("--limit", cl.audit.limit, "entries, newest first")
      ->check(CLI::Range(1, 10000))
      ->capture_default_str();
  audit->add_option("--user", cl.audit.user, "only this user's calls");
  audit->add_option("--job", cl.audit.job_id, "only calls about this job");
  app.add_subcommand("usage", "fair share: each user's recent GPU hours, jobs and limits");
  app.add_subcommand("merge",
                     "merge a LoRA adapter (a PEFT folder: a LoRA job's checkpoint) into its "
                     "base model, here, as you; runs megatrain-merge")
      ->add_option("base adapter out", cl.merge, "BASE ADAPTER OUT: the base model folder, the "
                   "adapter folder, and a new folder for the merged model (bf16)")
      ->expected(3)
      ->required();
  app.footer(Footer());
}

// megatrain-merge beside this binary (an install, a bundle), else in a build tree's
// engine/tools, else on PATH; exec'd with the arguments. Returns only when it cannot run.
int RunMerge(const std::vector<std::string>& args) {
  std::error_code ec;
  const std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe", ec);
  std::string tool = "megatrain-merge";
  for (const char* rel : {"megatrain-merge", "../engine/tools/megatrain-merge"}) {
    const std::filesystem::path candidate = self.parent_path() / rel;
    if (!ec && ::access(candidate.c_str(), X_OK) == 0) {
      tool = candidate.string();
      break;
    }
  }
  std::vector<char*> argv = {const_cast<char*>(tool.c_str())};
  for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  ::execvp(tool.c_str(), argv.data());
  std::fprintf(stderr, "error: megatrain merge runs %s, which cannot run: %s\n", tool.c_str(),
               std::strerror(errno));
  return kExitInternal;
}

int Dispatch(const Context& ctx, const CommandLine& cl) {
  const std::string& c = cl.command;
  if (c == "submit") return Submit(ctx, cl.submit);
  if (c == "list") return List(ctx, cl.list);
  if (c == "status") return Status(ctx, cl.job_id);
  if (c == "watch") return Watch(ctx, cl.job_id);
  if (c == "logs") return Logs(ctx, cl.job_id, cl.follow);
  if (c == "cancel") return Cancel(ctx, cl.job_id);
  if (c == "checkpoint") return Checkpoint(ctx, cl.job_id);
  if (c == "hold") return Hold(ctx, cl.job_id);
  if (c == "release") return Release(ctx, cl.job_id);
  if (c == "node") return Node(ctx);
  if (c == "plan") return Plan(ctx, cl.plan_spec_path);
  if (c == "whoami") return WhoAmI(ctx);
  if (c == "token") return Token(ctx, cl.token);
  if (c == "audit") return Audit(ctx, cl.audit);
  if (c == "usage") return Usage(ctx);
  if (c == "generate") return Generate(ctx, cl.generate);
  if (c == "eval") return Eval(ctx, cl.generate);
  std::fprintf(stderr, "error: subcommand '%s' is not implemented (a bug)\n", c.c_str());
  return kExitInternal;
}

int Run(int argc, char** argv, const Environment& env) {
  CLI::App app{"megatrain: submit, watch and manage jobs on megatraind: training, generate, eval"};
  CommandLine cl;
  try {
    DefineCommandLine(app, cl);
    if (argc <= 1) {
      std::fputs(app.help().c_str(), stderr);
      return kExitUsage;
    }
    app.parse(argc, argv);
    cl.command = app.get_subcommands().front()->get_name();
    if (cl.command == "token") {
      cl.token.action = app.get_subcommands().front()->get_subcommands().front()->get_name();
    }
    cl.timeout_given = app.get_option("--timeout")->count() > 0;
    if (cl.command == "merge") return RunMerge(cl.merge);  // local: no daemon
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? kExitOk : kExitUsage;  // --help and --version exit 0
  } catch (const CLI::Error& e) {
    std::fprintf(stderr, "error: the command line is defined wrongly (a bug): %s\n", e.what());
    return kExitInternal;
  }
  Security security;
  const std::string address = ResolveAddress(cl.addr, env.addr);
  if (address.rfind("unix:", 0) != 0) {
    absl::StatusOr<std::string> token = ResolveToken(cl.token_file, env.token, env.home);
    if (!token.ok()) {
      std::fprintf(stderr, "error: %s\n", std::string(token.status().message()).c_str());
      return kExitUsage;
    }
    security.token = *token;
    const std::string ca = cl.tls_ca.empty() ? env.tls_ca : cl.tls_ca;
    if (!ca.empty()) {
      std::ifstream in(ca);
      if (!in) {
        std::fprintf(stderr, "error: cannot read the TLS CA file %s\n", ca.c_str());
        return kExitUsage;
      }
      std::stringstream pem;
      pem << in.rdbuf();
      security.ca_pem = pem.str();
    }
  }
  const Context ctx =
      MakeContext(address, cl.output == "json" ? Output::kJson : Output::kTable, CurrentUser(),
                  cl.timeout_s, cl.timeout_given, security);
  return Dispatch(ctx, cl);
}

}  // namespace
}  // namespace megatrain::client

int main(int argc, char** argv) {
  auto value = [](const char* name) {
    const char* v = std::getenv(name);
    return std::string(v != nullptr ? v : "");
  };
  megatrain::client::Environment env;
  env.addr = value(megatrain::kAddressEnvVar);
  env.token = value(megatrain::client::kTokenEnvVar);
  env.tls_ca = value(megatrain::client::kTlsCaEnvVar);
  env.home = value("HOME");
  return megatrain::client::Run(argc, argv, env);
}
