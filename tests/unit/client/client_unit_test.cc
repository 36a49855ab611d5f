// The client library without a daemon: fallback loads (bytes equal the Python reference),
// on_missing=error, stale and foreign socket files, the daemon watcher, the tensor table and
// the C ABI (driven from a C translation unit).
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <condition_variable>
#include <cstring>
#include <mutex>

#include "client/daemon_watcher.h"
#include "client/discovery.h"
#include "client/tensor_table.h"
#include "os/unix_socket.h"
#include "support/test_env.h"
#include "unit/client/client_fixtures.h"
#include "weightcache/c_api.h"
#include "weightcache/client.h"

extern "C" int wc_c_smoke_fallback(const char* model, const char* runtime_dir, char* msg,
                                   size_t len);
extern "C" int wc_c_on_missing_error(const char* model, const char* runtime_dir, char* msg,
                                     size_t len);

namespace weightcache::testing {
namespace {

class ClientNoDaemonTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    if (!MakeReferenceCheckpoint(dir_.Join("model"), 12, 2, 3, "f32,bf16,f16,i8,u8,f8_e4m3", 4096,
                                 &ref_, &why)) {
      GTEST_SKIP() << why;
    }
    options_.model_dir = ref_.dir;
    options_.model_id = "unit";
    options_.runtime_dir = dir_.Join("run");
    options_.tier = Tier::kHost;
  }
  // The socket path discovery resolves for options_.
  std::string SocketPath() {
    auto id = client::ResolveIdentity(options_);
    EXPECT_TRUE(id.ok()) << id.status().ToString();
    EXPECT_TRUE(identity::EnsureCacheDirs(id->paths).ok());
    return id->paths.socket;
  }

  TempDir dir_;
  ReferenceCheckpoint ref_;
  AttachOptions options_;
};

TEST_F(ClientNoDaemonTest, FallbackLoadsBytesEqualToTheReferenceReader) {
  auto a = Attachment::Attach(options_);
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  EXPECT_EQ(a->source(), AttachSource::kFallback);
  EXPECT_NE(a->source_reason().find("no daemon at " + SocketPath()), std::string::npos)
      << a->source_reason();
  EXPECT_EQ(a->device_key(), "host");
  EXPECT_FALSE(a->daemon_alive());
  EXPECT_EQ(a->daemon_pid(), 0);
  EXPECT_EQ(CompareWithReference(*a, ref_), "");
  for (const Tensor& t : a->tensors()) {
    EXPECT_EQ(t.data % 256, 0u) << t.name << " is not 256-byte aligned";
  }
}

TEST_F(ClientNoDaemonTest, OnMissingErrorIsNoDaemonNamingTheSocket) {
  options_.on_missing = OnMissing::kError;
  auto a = Attachment::Attach(options_);
  ASSERT_FALSE(a.ok());
  EXPECT_EQ(a.status().code(), StatusCode::kNoDaemon);
  EXPECT_NE(a.status().message().find("no daemon at " + SocketPath()), std::string::npos)
      << a.status().ToString();
}

TEST_F(ClientNoDaemonTest, StaleSocketWithoutLockIsTreatedAsAbsent) {
  const std::string path = SocketPath();
  {
    // A socket file left by a dead daemon: bound, then the fd closed; nobody holds the lock.
    auto listener = os::ListenUnix(path);
    ASSERT_TRUE(listener.ok()) << listener.status().ToString();
  }
  options_.on_missing = OnMissing::kError;
  auto a = Attachment::Attach(options_);
  ASSERT_FALSE(a.ok());
  EXPECT_EQ(a.status().code(), StatusCode::kNoDaemon);
  EXPECT_NE(a.status().message().find("stale socket " + path), std::string::npos)
      << a.status().ToString();

  options_.on_missing = OnMissing::kFallback;
  auto b = Attachment::Attach(options_);
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  EXPECT_EQ(b->source(), AttachSource::kFallback);
  EXPECT_EQ(CompareWithReference(*b, ref_), "");
}

TEST_F(ClientNoDaemonTest, SomethingThatIsNotASocketIsAnErrorNotAFallback) {
  const std::string path = SocketPath();
  WriteFile(path, "not a socket");
  auto a = Attachment::Attach(options_);
  ASSERT_FALSE(a.ok());
  EXPECT_EQ(a.status().code(), StatusCode::kIo);
  EXPECT_NE(a.status().message().find(path + " exists but is not a socket"), std::string::npos)
      << a.status().ToString();
}

TEST_F(ClientNoDaemonTest, BadOptionsAreInvalidArgument) {
  options_.tp_size = 2;
  options_.tp_rank = 2;
  auto a = Attachment::Attach(options_);
  ASSERT_FALSE(a.ok());
  EXPECT_EQ(a.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(a.status().message().find("tp_rank"), std::string::npos) << a.status().ToString();

  options_.tp_rank = -1;
  auto b = Attachment::Attach(options_);
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(b.status().message().find("tp_rank must not be negative"), std::string::npos);
}

TEST_F(ClientNoDaemonTest, CAbiFromPlainC) {
  char msg[512] = {};
  int rc = wc_c_smoke_fallback(ref_.dir.c_str(), options_.runtime_dir.c_str(), msg, sizeof(msg));
  EXPECT_EQ(rc, 0) << msg;
  EXPECT_NE(std::string(msg).find("12 tensors"), std::string::npos) << msg;

  rc = wc_c_on_missing_error(ref_.dir.c_str(), options_.runtime_dir.c_str(), msg, sizeof(msg));
  EXPECT_EQ(rc, WC_NO_DAEMON) << msg;
  EXPECT_NE(std::string(msg).find("no daemon at"), std::string::npos) << msg;
  EXPECT_STREQ(wc_status_code_name(WC_MISMATCH), "mismatch");
}

TEST(DaemonWatcherTest, CallbackFiresOnceWhenThePeerCloses) {
  auto pair = os::SocketPair();
  ASSERT_TRUE(pair.ok());
  auto watcher = client::DaemonWatcher::Create(std::move(pair->first));
  ASSERT_TRUE(watcher.ok());
  EXPECT_TRUE((*watcher)->alive());

  std::mutex mu;
  std::condition_variable cv;
  int fired = 0;
  (*watcher)->OnGone([&] {
    std::lock_guard<std::mutex> lock(mu);
    ++fired;
    cv.notify_all();
  });
  // Unsolicited bytes are drained, not mistaken for a death.
  ASSERT_EQ(::write(pair->second.get(), "x", 1), 1);
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_TRUE((*watcher)->alive());
  pair->second.Reset();  // the "daemon" dies

  std::unique_lock<std::mutex> lock(mu);
  ASSERT_TRUE(cv.wait_for(lock, std::chrono::seconds(5), [&] { return fired == 1; }));
  lock.unlock();
  EXPECT_FALSE((*watcher)->alive());
  bool late = false;
  (*watcher)->OnGone([&] { late = true; });  // after the fact: runs at once, here
  EXPECT_TRUE(late);
  EXPECT_EQ(fired, 1);
}

TEST(DaemonWatcherTest, DestroyingWithAPendingCallbackJoinsCleanly) {
  auto pair = os::SocketPair();
  ASSERT_TRUE(pair.ok());
  auto watcher = client::DaemonWatcher::Create(std::move(pair->first));
  ASSERT_TRUE(watcher.ok());
  bool fired = false;
  (*watcher)->OnGone([&] { fired = true; });
  watcher->reset();  // the daemon is still alive: the thread is woken by the eventfd
  EXPECT_FALSE(fired);
}

TEST(TensorTableTest, ContiguousStridesAndLookup) {
  std::vector<int64_t> shape = {2, 3, 4};
  EXPECT_EQ(client::ContiguousStrides(shape), (std::vector<int64_t>{12, 4, 1}));
  EXPECT_TRUE(client::ContiguousStrides({}).empty());
  std::vector<Tensor> table;
  std::vector<uint64_t> s = {5};
  table.push_back(client::MakeTensor("b", "F32", s, 0x100, 20, 1));
  table.push_back(client::MakeTensor("a", "BF16", s, 0x200, 10, 2));
  client::SortByName(table);
  ASSERT_NE(client::FindByName(table, "b"), nullptr);
  EXPECT_EQ(client::FindByName(table, "b")->data, 0x100u);
  EXPECT_EQ(client::FindByName(table, "a")->strides, (std::vector<int64_t>{1}));
  EXPECT_EQ(client::FindByName(table, "c"), nullptr);
}

}  // namespace
}  // namespace weightcache::testing
