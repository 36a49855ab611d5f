// The client library without a daemon: fallback loads (bytes equal the Python reference),
// on_missing=error, stale and foreign socket files, the daemon watcher, the tensor table and
// the C ABI (driven from a C translation unit).
#include <gtest/gtest.h>
#include <linux/sockios.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
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
    options_.identity.model_dir = ref_.dir;
    options_.identity.model_id = "unit";
    options_.identity.runtime_dir = dir_.Join("run");
    options_.identity.tier = Tier::kHost;
  }
  // The socket path discovery resolves for options_.
  std::string SocketPath() {
    auto id = identity::ResolveIdentity(options_.identity);
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
  options_.identity.tp_size = 2;
  options_.identity.tp_rank = 2;
  auto a = Attachment::Attach(options_);
  ASSERT_FALSE(a.ok());
  EXPECT_EQ(a.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(a.status().message().find("tp_rank"), std::string::npos) << a.status().ToString();

  options_.identity.tp_rank = -1;
  auto b = Attachment::Attach(options_);
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(b.status().message().find("tp_rank must not be negative"), std::string::npos);
}

TEST_F(ClientNoDaemonTest, CAbiFromPlainC) {
  char msg[512] = {};
  int rc = wc_c_smoke_fallback(ref_.dir.c_str(), options_.identity.runtime_dir.c_str(), msg,
                               sizeof(msg));
  EXPECT_EQ(rc, 0) << msg;
  EXPECT_NE(std::string(msg).find("12 tensors"), std::string::npos) << msg;

  rc = wc_c_on_missing_error(ref_.dir.c_str(), options_.identity.runtime_dir.c_str(), msg,
                             sizeof(msg));
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
  // Unsolicited bytes are drained, not mistaken for a death. The drain is observed, not
  // slept on: the sender's SIOCOUTQ counts the bytes the receiver has not read yet, so it
  // reaches 0 only once the watcher thread has read the byte (without a watcher it stays 1).
  ASSERT_EQ(::write(pair->second.get(), "x", 1), 1);
  int unread = -1;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (std::chrono::steady_clock::now() < deadline) {
    ASSERT_EQ(::ioctl(pair->second.get(), SIOCOUTQ, &unread), 0) << std::strerror(errno);
    if (unread == 0) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ASSERT_EQ(unread, 0) << "the watcher never read the unsolicited byte";
  EXPECT_TRUE((*watcher)->alive()) << "a drained byte is not a death";
  {
    std::lock_guard<std::mutex> lock(mu);
    EXPECT_EQ(fired, 0);
  }
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

TEST(TensorTableTest, ContiguousStrides) {
  std::vector<int64_t> shape = {2, 3, 4};
  std::vector<int64_t> strides(3);
  client::ContiguousStrides(shape, strides);
  EXPECT_EQ(strides, (std::vector<int64_t>{12, 4, 1}));
  client::ContiguousStrides({}, {});  // rank 0: nothing to write
}

TEST(TensorTableTest, ViewsIntoOneTableSortedAndNulTerminated) {
  client::TensorTable table;
  const std::vector<uint64_t> matrix = {2, 3}, vector = {5}, scalar = {};
  table.Reserve(3, /*name_bytes=*/std::string_view("b.weight").size() + 1 + 3, /*dims=*/3);
  ASSERT_TRUE(table.Add("b.weight", checkpoint::DType::kF32, matrix, 0x100, 24, 1).ok());
  ASSERT_TRUE(table.Add("a", checkpoint::DType::kBF16, vector, 0x200, 10, 2).ok());
  ASSERT_TRUE(table.Add("c.s", checkpoint::DType::kI64, scalar, 0x300, 8, 3).ok());
  table.Finish();

  ASSERT_EQ(table.size(), 3u);
  EXPECT_EQ(table.tensors()[0].name, "a");  // sorted by name
  EXPECT_EQ(table.tensors()[1].name, "b.weight");
  EXPECT_EQ(table.tensors()[2].name, "c.s");
  for (const Tensor& t : table.tensors()) {
    EXPECT_EQ(t.name.data()[t.name.size()], '\0') << t.name;  // C strings for the C ABI
    EXPECT_EQ(t.dtype.data()[t.dtype.size()], '\0') << t.dtype;
    EXPECT_EQ(t.strides.size(), t.shape.size()) << t.name;
  }
  const Tensor* b = table.Find("b.weight");
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(b->data, 0x100u);
  EXPECT_EQ(b->dtype, "F32");
  EXPECT_TRUE(std::ranges::equal(b->shape, std::vector<int64_t>{2, 3}));
  EXPECT_TRUE(std::ranges::equal(b->strides, std::vector<int64_t>{3, 1}));
  EXPECT_TRUE(table.Find("c.s")->shape.empty());
  EXPECT_EQ(table.Find("c"), nullptr);
  EXPECT_EQ(table.Find("b"), nullptr);

  // Moving the table moves its buffers: the views stay valid.
  const char* name_storage = b->name.data();
  client::TensorTable moved = std::move(table);
  EXPECT_EQ(moved.Find("b.weight")->name.data(), name_storage);
}

TEST(TensorTableTest, AddBeyondTheReservationIsAnInternalError) {
  client::TensorTable table;
  const std::vector<uint64_t> vector = {4};
  table.Reserve(1, /*name_bytes=*/1, /*dims=*/1);
  ASSERT_TRUE(table.Add("a", checkpoint::DType::kU8, vector, 0, 4, 0).ok());
  Status second = table.Add("b", checkpoint::DType::kU8, vector, 0, 4, 0);
  EXPECT_EQ(second.code(), StatusCode::kInternal);
  EXPECT_NE(second.message().find("reservation exceeded at tensor 1 (b)"), std::string::npos)
      << second.ToString();

  client::TensorTable names;
  names.Reserve(2, /*name_bytes=*/2, /*dims=*/0);
  ASSERT_TRUE(names.Add("ab", checkpoint::DType::kU8, {}, 0, 1, 0).ok());
  Status long_name = names.Add("c", checkpoint::DType::kU8, {}, 0, 1, 0);
  EXPECT_EQ(long_name.code(), StatusCode::kInternal) << long_name.ToString();
}

}  // namespace
}  // namespace weightcache::testing
