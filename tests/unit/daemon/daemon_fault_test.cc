// The daemon's event loop in process (InProcessDaemon) over faulty syscalls (its Env's
// SysCalls): a failed accept, recvmsg or sendmsg, and a client that disconnects mid-frame,
// each cost at most that one connection; the daemon keeps serving the clients already attached
// and the next ones. The clients are real (the public Attach, real sockets) and so is the
// checkpoint (written by the Python safetensors library).
#include <gtest/gtest.h>
#include <unistd.h>

#include <cerrno>
#include <memory>
#include <optional>
#include <string>

#include "common/mutex.h"
#include "os/unix_socket.h"
#include "support/test_env.h"
#include "unit/client/client_fixtures.h"
#include "unit/daemon/in_process_daemon.h"
#include "weightcache/client.h"

namespace weightcache::testing {
namespace {

enum class Call { kAccept, kRecv, kSend };

// The daemon's syscalls, with one failure armed at a time: the nth call of a kind from the
// arming on returns -1 with `err`, touching nothing. A recv or send failure is armed for the
// next connection the daemon accepts: the daemon's last recv on a connection already served
// (reading to EAGAIN after its reply went out) may come after the test armed it, and must not
// take the failure. Counters are read by the test thread while the daemon's thread makes the
// calls.
class FaultySysCalls : public os::SysCalls {
 public:
  void Fail(Call call, int nth, int err) {
    MutexLock lock(mu_);
    armed_ = Armed{call, nth, err, call == Call::kAccept ? kAnyFd : kNextAccepted};
  }
  int injected() const {
    MutexLock lock(mu_);
    return injected_;
  }
  int calls(Call call) const {
    MutexLock lock(mu_);
    return calls_[Index(call)];
  }

  ssize_t SendMsg(int fd, const msghdr* msg, int flags) override {
    if (Inject(Call::kSend, fd)) return -1;
    return SysCalls::SendMsg(fd, msg, flags);
  }
  ssize_t RecvMsg(int fd, msghdr* msg, int flags) override {
    if (Inject(Call::kRecv, fd)) return -1;
    return SysCalls::RecvMsg(fd, msg, flags);
  }
  int Accept4(int fd, sockaddr* addr, socklen_t* addr_len, int flags) override {
    if (Inject(Call::kAccept, fd)) return -1;
    const int accepted = SysCalls::Accept4(fd, addr, addr_len, flags);
    MutexLock lock(mu_);
    if (accepted >= 0 && armed_ && armed_->fd == kNextAccepted) armed_->fd = accepted;
    return accepted;
  }

 private:
  static constexpr int kAnyFd = -1;
  static constexpr int kNextAccepted = -2;  // not yet accepted: no call matches
  struct Armed {
    Call call;
    int remaining;  // calls to go, this one included
    int err;
    int fd;  // the calls counted: kAnyFd, or those on this fd
  };
  static size_t Index(Call call) { return static_cast<size_t>(call); }
  bool Inject(Call call, int fd) {
    MutexLock lock(mu_);
    ++calls_[Index(call)];
    if (!armed_ || armed_->call != call) return false;
    if (armed_->fd != kAnyFd && armed_->fd != fd) return false;
    if (--armed_->remaining > 0) return false;
    errno = armed_->err;
    armed_.reset();
    ++injected_;
    return true;
  }

  mutable Mutex mu_;
  int calls_[3] WEIGHTCACHE_GUARDED_BY(mu_) = {0, 0, 0};
  std::optional<Armed> armed_ WEIGHTCACHE_GUARDED_BY(mu_);
  int injected_ WEIGHTCACHE_GUARDED_BY(mu_) = 0;
};

class DaemonFaultTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    if (!MakeReferenceCheckpoint(dir_.Join("model"), 6, 2, 11, "f32,bf16", 2048, &ref_, &why)) {
      GTEST_SKIP() << why;
    }
    options_.identity.model_dir = ref_.dir;
    options_.identity.model_id = "faults";
    options_.identity.runtime_dir = dir_.Join("run");
    options_.identity.tier = Tier::kHost;
    // A lost connection is a missing daemon (issue 39 §5.7): on_missing=error makes it a
    // kNoDaemon failure the tests can see, where the default would fall back.
    options_.on_missing = OnMissing::kError;
    env_ = identity::Env::Default();
    env_.syscalls = &sys_;
    env_.lookup = identity::MapEnv({});
    auto started = InProcessDaemon::StartLoaded(options_.identity, env_);
    ASSERT_TRUE(started.ok()) << started.status().ToString();
    daemon_ = std::move(started).value();
  }
  void TearDown() override {
    if (daemon_) {
      EXPECT_TRUE(daemon_->Stop().ok());
    }
  }

  // An attach that must come from the daemon, with the reference bytes.
  void ExpectAttaches() {
    auto a = Attachment::Attach(options_);
    ASSERT_TRUE(a.ok()) << a.status().ToString();
    EXPECT_EQ(a->source(), AttachSource::kDaemon);
    EXPECT_EQ(a->daemon_pid(), ::getpid());
    EXPECT_EQ(CompareWithReference(*a, ref_), "");
  }

  // The attach whose connection the daemon dropped: the client sees the connection end where
  // the HelloReply should be, takes the daemon for gone (kNoDaemon under on_missing=error; a
  // fallback by default), and says which daemon.
  void ExpectDroppedConnection() {
    auto a = Attachment::Attach(options_);
    ASSERT_FALSE(a.ok());
    EXPECT_EQ(a.status().code(), StatusCode::kNoDaemon) << a.status().ToString();
    EXPECT_NE(a.status().message().find("daemon at " + daemon_->socket() + " (pid " +
                                        std::to_string(::getpid()) +
                                        ") went away during the attach (Hello): reading the "
                                        "reply of daemon at " +
                                        daemon_->socket()),
              std::string::npos)
        << a.status().ToString();
  }

  TempDir dir_;
  ReferenceCheckpoint ref_;
  AttachOptions options_;
  FaultySysCalls sys_;
  identity::Env env_;
  std::unique_ptr<InProcessDaemon> daemon_;
};

TEST_F(DaemonFaultTest, ServesAttachesThroughTheEnvsSyscalls) {
  ExpectAttaches();
  EXPECT_GE(sys_.calls(Call::kAccept), 1);
  EXPECT_GE(sys_.calls(Call::kRecv), 1);
  EXPECT_GE(sys_.calls(Call::kSend), 1);
}

TEST_F(DaemonFaultTest, AFailedAcceptPausesTheListenerAndThePendingClientIsServedAfter) {
  sys_.Fail(Call::kAccept, 1, EMFILE);
  ExpectAttaches();
  EXPECT_EQ(sys_.injected(), 1);
  EXPECT_GE(sys_.calls(Call::kAccept), 2);  // the failed one, then the one that took the client
}

TEST_F(DaemonFaultTest, AFailedRecvmsgDropsThatConnectionOnly) {
  auto attached = Attachment::Attach(options_);
  ASSERT_TRUE(attached.ok()) << attached.status().ToString();
  sys_.Fail(Call::kRecv, 1, ECONNRESET);
  ExpectDroppedConnection();
  EXPECT_EQ(sys_.injected(), 1);
  EXPECT_TRUE(attached->daemon_alive());
  ExpectAttaches();
}

TEST_F(DaemonFaultTest, AFailedSendmsgDropsThatConnectionOnly) {
  auto attached = Attachment::Attach(options_);
  ASSERT_TRUE(attached.ok()) << attached.status().ToString();
  sys_.Fail(Call::kSend, 1, EPIPE);
  ExpectDroppedConnection();
  EXPECT_EQ(sys_.injected(), 1);
  EXPECT_TRUE(attached->daemon_alive());
  ExpectAttaches();
}

TEST_F(DaemonFaultTest, AClientThatDisconnectsMidFrameCostsOnlyItsConnection) {
  auto attached = Attachment::Attach(options_);
  ASSERT_TRUE(attached.ok()) << attached.status().ToString();
  {
    auto raw = os::ConnectUnix(daemon_->socket(), std::chrono::milliseconds(60'000));
    ASSERT_TRUE(raw.ok()) << raw.status().ToString();
    const char half_header[5] = {'W', 'C', 'F', 'R', 0};  // fewer bytes than a frame header
    ASSERT_EQ(::write(raw->get(), half_header, sizeof(half_header)),
              static_cast<ssize_t>(sizeof(half_header)));
  }  // closed here, mid-frame
  EXPECT_TRUE(attached->daemon_alive());
  ExpectAttaches();
}

}  // namespace
}  // namespace weightcache::testing
