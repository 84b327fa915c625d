// The sharing building blocks: the daemon's config (limits, roots, TLS), tokens, account
// lookup, admin membership, acting as a user on files (server/run_as.h) and the path
// policy. Acting as another user needs root; those tests skip otherwise.
#include <pwd.h>
#include <grp.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <vector>
#include <set>

#include "gtest/gtest.h"
#include "server/config.h"
#include "server/identity.h"
#include "server/run_as.h"

namespace megatrain::server {
namespace {

namespace fs = std::filesystem;

class TempDir {
 public:
  TempDir() {
    std::string t = (fs::temp_directory_path() / "access_test.XXXXXX").string();
    path_ = mkdtemp(t.data());
    chmod(path_.c_str(), 0755);
  }
  ~TempDir() { fs::remove_all(path_); }
  const std::string& path() const { return path_; }
  std::string Write(const std::string& name, const std::string& text, mode_t mode) const {
    const std::string p = path_ + "/" + name;
    std::ofstream(p) << text;
    chmod(p.c_str(), mode);
    return p;
  }

 private:
  std::string path_;
};

TEST(DaemonConfig, DefaultStateDirIsUnderTheHomeMainRead) {
  if (geteuid() == 0) {  // root's daemon is the system's, whatever $HOME says
    EXPECT_EQ(DefaultDaemonConfig("/home/alice").state_dir, "/var/lib/megatrain");
    return;
  }
  EXPECT_EQ(DefaultDaemonConfig("/home/alice").state_dir, "/home/alice/.local/state/megatrain");
  EXPECT_EQ(DefaultDaemonConfig("").state_dir, "/tmp/.local/state/megatrain");
}

TEST(DaemonConfig, ShippedExampleLoads) {
  DaemonConfig c = DefaultDaemonConfig("");
  ASSERT_TRUE(LoadDaemonConfig(MT_SOURCE_DIR "/deploy/megatraind.yaml", &c).ok());
  EXPECT_EQ(c.admin_group, "megatrain-admin");
  EXPECT_EQ(c.file_roots.front(), "/home");
  EXPECT_EQ(c.limits.max_priority, 10);
  EXPECT_TRUE(c.preemption);
}

TEST(DaemonConfig, LimitsPerUserOverrideTheDefaults) {
  TempDir dir;
  const std::string path = dir.Write("c.yaml",
                                     "limits: {max_queued_jobs: 5, max_host_memory_gib: 2}\n"
                                     "user_limits:\n  alice: {max_priority: 20}\n",
                                     0644);
  DaemonConfig c = DefaultDaemonConfig("");
  ASSERT_TRUE(LoadDaemonConfig(path, &c).ok());
  EXPECT_EQ(c.LimitsFor("bob").max_queued_jobs, 5);
  EXPECT_EQ(c.LimitsFor("bob").max_host_bytes, 2ll << 30);
  EXPECT_EQ(c.LimitsFor("bob").max_priority, 10);
  // alice's entry starts from `limits` and changes one field.
  EXPECT_EQ(c.LimitsFor("alice").max_priority, 20);
  EXPECT_EQ(c.LimitsFor("alice").max_queued_jobs, 5);
}

TEST(DaemonConfig, BadSharingFieldsAreRefusedNamingThem) {
  TempDir dir;
  struct Case {
    const char* yaml;
    const char* needle;
  } cases[] = {
      {"limits: {max_jobs: 3}\n", "unknown field 'max_jobs'"},
      {"limits: {max_queued_jobs: -1}\n", "0 (none) or positive"},
      {"file_roots: [relative/dir]\n", "file_roots must be absolute"},
      {"tcp_listen: 0.0.0.0:7000\n", "tcp_listen needs tls_cert and tls_key"},
      {"fair_share_half_life_hours: 0\n", "fair_share_half_life_hours must be positive"},
      {"user_limits: [alice]\n", "user_limits must be a mapping"},
  };
  for (const Case& c : cases) {
    const std::string path = dir.Write("bad.yaml", c.yaml, 0644);
    DaemonConfig config = DefaultDaemonConfig("");
    absl::Status s = LoadDaemonConfig(path, &config);
    EXPECT_FALSE(s.ok()) << c.yaml;
    EXPECT_NE(s.message().find(c.needle), absl::string_view::npos) << s << " for " << c.yaml;
  }
}

TEST(Tokens, HashIsSha256AndTokensAreFreshAndWellFormed) {
  // FIPS 180-2 test vector.
  EXPECT_EQ(TokenHash("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  std::set<std::string> seen;
  for (int i = 0; i < 100; ++i) {
    const std::string t = NewToken();
    ASSERT_EQ(t.size(), 3u + 64u);
    EXPECT_EQ(t.substr(0, 3), "mt_");
    EXPECT_EQ(t.find_first_not_of("0123456789abcdef", 3), std::string::npos) << t;
    EXPECT_TRUE(seen.insert(t).second) << "a token repeated";
  }
}

TEST(Accounts, LookupByUidAndNameAgreeAndUnknownIsNotFound) {
  absl::StatusOr<Caller> root = LookupUid(0);
  ASSERT_TRUE(root.ok()) << root.status();
  EXPECT_EQ(root->user, "root");
  ASSERT_FALSE(root->groups.empty());
  EXPECT_EQ(root->groups.front(), root->gid);  // primary first
  absl::StatusOr<Caller> by_name = LookupUser("root");
  ASSERT_TRUE(by_name.ok());
  EXPECT_EQ(by_name->uid, 0u);
  EXPECT_EQ(LookupUser("no-such-user-megatrain").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(LookupUid(4000000000u).status().code(), absl::StatusCode::kNotFound);
}

TEST(Accounts, AdminsAreRootAndTheAdminGroup) {
  Authenticator auth(nullptr, "root");  // the group "root" as the admin group
  absl::StatusOr<Caller> nobody = LookupUid(65534);
  if (!nobody.ok()) GTEST_SKIP() << "no 'nobody' account";
  auth.SetAdmin(&*nobody);
  EXPECT_FALSE(nobody->admin);
  nobody->groups.push_back(0);  // as if nobody were in group root
  auth.SetAdmin(&*nobody);
  EXPECT_TRUE(nobody->admin);
  Authenticator no_group(nullptr, "");
  absl::StatusOr<Caller> root = LookupUid(0);
  no_group.SetAdmin(&*root);
  EXPECT_TRUE(root->admin);
}

TEST(PathPolicy, RootsAndTheStateFolder) {
  TempDir dir;
  fs::create_directories(dir.path() + "/in/sub");
  fs::create_directories(dir.path() + "/out");
  fs::create_directories(dir.path() + "/state/jobs/7");
  fs::create_symlink(dir.path() + "/out", dir.path() + "/in/escape");
  const FileRoots roots{{dir.path() + "/in", dir.path() + "/state"}, dir.path() + "/state"};
  EXPECT_TRUE(CheckPathAllowed("data.path", dir.path() + "/in/sub/x.jsonl", roots, "").ok());
  // Not yet existing is fine (a checkpoint folder to create).
  EXPECT_TRUE(CheckPathAllowed("checkpoint.dir", dir.path() + "/in/new/ck", roots, "").ok());
  absl::Status out = CheckPathAllowed("data.path", dir.path() + "/out/x", roots, "");
  EXPECT_EQ(out.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_NE(out.message().find("data.path: "), absl::string_view::npos) << out;
  // A link out of a root is judged by where it leads; so is "..".
  EXPECT_FALSE(CheckPathAllowed("data.path", dir.path() + "/in/escape/x", roots, "").ok());
  EXPECT_FALSE(CheckPathAllowed("data.path", dir.path() + "/in/../out/x", roots, "").ok());
  // A root must match whole components: /in is not a prefix of /inside.
  EXPECT_FALSE(CheckPathAllowed("data.path", dir.path() + "/inside/x", roots, "").ok());
  // The state folder only for the job's own folder.
  const std::string job7 = dir.path() + "/state/jobs/7";
  EXPECT_TRUE(CheckPathAllowed("checkpoint.dir", job7 + "/checkpoints", roots, job7).ok());
  absl::Status db = CheckPathAllowed("checkpoint.dir", dir.path() + "/state/x", roots, job7);
  EXPECT_NE(db.message().find("state folder"), absl::string_view::npos) << db;
  EXPECT_FALSE(CheckPathAllowed("checkpoint.dir", dir.path() + "/state/jobs/8", roots, job7).ok());
  // The job's own folder needs no root: roots name the users' folders, not the daemon's.
  const FileRoots homes_only{{dir.path() + "/in"}, dir.path() + "/state"};
  EXPECT_TRUE(CheckPathAllowed("checkpoint.dir", job7 + "/checkpoints", homes_only, job7).ok());
  EXPECT_FALSE(CheckPathAllowed("checkpoint.dir", job7 + "/checkpoints", homes_only, "").ok());
}

class AsUser : public ::testing::Test {
 protected:
  void SetUp() override {
    if (geteuid() != 0) GTEST_SKIP() << "acting as another user needs root";
    absl::StatusOr<Caller> nobody = LookupUid(65534);
    if (!nobody.ok()) GTEST_SKIP() << "no 'nobody' account";
    nobody_ = *nobody;
  }
  Caller nobody_;
};

// Runs `check` in a child process with `who`'s credentials, as a worker process has them
// (server/worker_process.h); whether it returned true there.
bool InChildAs(const Caller& who, const std::function<bool()>& check) {
  const pid_t pid = fork();
  if (pid == 0) {
    std::vector<gid_t> groups = who.groups;
    if (groups.empty()) groups.push_back(who.gid);
    if (setgroups(groups.size(), groups.data()) != 0 || setresgid(who.gid, who.gid, who.gid) != 0 ||
        setresuid(who.uid, who.uid, who.uid) != 0) {
      _exit(2);
    }
    _exit(check() ? 0 : 1);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

TEST_F(AsUser, AsTheUserOnlyTheirFoldersAreWritableAndWhatTheyMakeIsTheirs) {
  TempDir dir;
  const std::string mine = dir.path() + "/nobodys";
  fs::create_directories(mine);
  chown(mine.c_str(), nobody_.uid, nobody_.gid);
  EXPECT_TRUE(InChildAs(nobody_, [&] {
    const absl::Status in_root_dir = CheckWritableFolder("checkpoint.dir", dir.path());  // 0755
    return in_root_dir.code() == absl::StatusCode::kPermissionDenied &&
           in_root_dir.message().find("checkpoint.dir: cannot write in") != absl::string_view::npos;
  }));
  EXPECT_TRUE(InChildAs(nobody_, [&] {
    return CheckWritableFolder("checkpoint.dir", mine + "/ck").ok();
  }));
  struct stat st {};
  ASSERT_EQ(stat((mine + "/ck").c_str(), &st), 0);
  EXPECT_EQ(st.st_uid, nobody_.uid);
}

TEST_F(AsUser, JobFolderLeftByAnOlderDaemonBecomesTheUsers) {
  TempDir dir;
  const std::string state = dir.path() + "/state";
  const std::string old = state + "/jobs/5/checkpoints/checkpoint-3";
  fs::create_directories(old);
  std::ofstream(old + "/model.safetensors") << "x";
  fs::create_symlink("/etc/hostname", old + "/link");  // changed, never followed
  ASSERT_TRUE(MakeJobFolder(state, 5, nobody_).ok());
  struct stat st {};
  ASSERT_EQ(stat((old + "/model.safetensors").c_str(), &st), 0);
  EXPECT_EQ(st.st_uid, nobody_.uid);
  ASSERT_EQ(stat("/etc/hostname", &st), 0);
  EXPECT_EQ(st.st_uid, 0u);
}

TEST_F(AsUser, JobFolderIsTheUsersAndReachable) {
  TempDir dir;
  const std::string state = dir.path() + "/state";
  fs::create_directories(state);
  chmod(state.c_str(), 0700);
  absl::StatusOr<std::string> folder = MakeJobFolder(state, 12, nobody_);
  ASSERT_TRUE(folder.ok()) << folder.status();
  struct stat st {};
  ASSERT_EQ(stat(folder->c_str(), &st), 0);
  EXPECT_EQ(st.st_uid, nobody_.uid);
  EXPECT_EQ(st.st_mode & 0777, 0700u);
  ASSERT_EQ(stat(state.c_str(), &st), 0);
  EXPECT_NE(st.st_mode & S_IXOTH, 0u);  // traversable, so the user reaches their folder
  EXPECT_EQ(st.st_mode & S_IROTH, 0u);  // but cannot list the state folder
  EXPECT_TRUE(InChildAs(nobody_, [&] {
    return CheckWritableFolder("checkpoint.dir", *folder + "/checkpoints").ok();
  }));
}

}  // namespace
}  // namespace megatrain::server
