// libFuzzer target for the wire protocol decoders (protocol/frame.h, messages.h, manifest.h):
// everything a daemon or client parses from a peer. The input is treated as a frame header
// followed by a payload, as a bare payload for every payload decoder (the binary attach
// manifest included), as the content of the sealed manifest memfd of an AttachReply (decoded
// through DecodeAttachReply, as a client does), and as a byte stream fed through FrameReader
// over a real socketpair.
// Beyond "no crash, no sanitizer report" it checks the decoders' promises on what they
// accept: manifest bounds hold and re-encoding gives the same table, accepted control
// messages re-encode and decode again. Build and run: scripts/fuzz.sh frame_fuzzer.
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "os/fd_passing.h"
#include "os/unix_socket.h"
#include "protocol/frame.h"
#include "protocol/handoff.h"
#include "protocol/manifest.h"
#include "protocol/messages.h"

namespace {

using namespace weightcache::protocol;  // NOLINT: a fuzz target's one namespace

void Check(bool condition) {
  if (!condition) __builtin_trap();
}

void CheckManifest(const Manifest& m) {
  const auto& allocs = m.allocation_sizes();
  Check(allocs.size() <= kMaxAllocations);
  std::vector<TensorEntry> entries;
  for (size_t i = 0; i < m.tensor_count(); ++i) {
    const TensorEntry t = m.tensor(i);
    Check(!t.name.empty() && t.ndim <= kMaxTensorDims);
    Check(t.allocation < allocs.size());
    Check(t.offset <= allocs[t.allocation] && t.nbytes <= allocs[t.allocation] - t.offset);
    Check(i == 0 || entries.back().name < t.name);  // strictly ascending, hence unique
    // The in-place views the client hands out: a C-string name, contiguous strides.
    const TensorRecord r = m.record(i);
    Check(r.name == t.name && r.name.data()[r.name.size()] == '\0');
    Check(r.shape.size() == t.ndim && r.strides.size() == t.ndim);
    int64_t stride = 1;
    for (size_t d = t.ndim; d-- > 0;) {
      Check(r.shape[d] >= 0 && r.strides[d] == stride);
      if (d > 0) stride *= r.shape[d];  // no overflow: the decoder checked it
    }
    entries.push_back(t);
  }
  // What was accepted encodes again (same checks), and decodes to the same table; the records
  // are already in name order, so the encoder keeps it.
  auto again = EncodeManifest(m.tier(), allocs, entries);
  Check(again.ok());
  auto back = Manifest::Decode(*again);
  Check(back.ok());
  Check(back->tensor_count() == m.tensor_count());
  for (size_t i = 0; i < m.tensor_count(); ++i) {
    const TensorEntry a = m.tensor(i);
    const TensorEntry b = back->tensor(i);
    Check(a.name == b.name && a.dtype == b.dtype && a.ndim == b.ndim && a.shape == b.shape &&
          a.allocation == b.allocation && a.offset == b.offset && a.nbytes == b.nbytes &&
          a.checksum == b.checksum);
  }
}

// The attach path proper: the bytes in a sealed memfd, announced in an AttachReply, mapped and
// decoded by DecodeAttachReply (as a client does), with allocation memfds alongside.
void DecodeAsAttachReply(std::span<const uint8_t> manifest) {
  auto fd = CreateManifestMemfd(manifest, "frame_fuzzer");
  if (!fd.ok()) return;
  Frame frame;
  frame.type = MessageType::kAttachReply;
  auto encoded = EncodeAttachReply(manifest.size(), 0);
  Check(encoded.ok());
  frame.payload.assign(encoded->begin() + kFrameHeaderSize, encoded->end());
  frame.fds.push_back(std::move(fd).value());
  auto reply = DecodeAttachReply(std::move(frame));
  // With no allocation fds, only a manifest of 0 allocations can be accepted.
  if (reply.ok()) {
    Check(reply->manifest.allocation_sizes().empty() && reply->fds.empty());
    CheckManifest(reply->manifest);
  }
}

// Decode with `decode`; if accepted, re-encode with `encode` and decode the new payload.
template <typename Decode, typename Encode>
void RoundTrip(std::span<const uint8_t> payload, Decode decode, Encode encode) {
  auto msg = decode(payload);
  if (!msg.ok()) return;
  auto frame = encode(*msg);
  Check(frame.ok());
  Check(decode(std::span<const uint8_t>(*frame).subspan(kFrameHeaderSize)).ok());
}

void DecodePayloadEverywhere(std::span<const uint8_t> payload) {
  RoundTrip(payload, DecodeHello, EncodeHello);
  RoundTrip(payload, DecodeHelloReply, EncodeHelloReply);
  RoundTrip(payload, DecodeStatusReply, EncodeStatusReply);
  RoundTrip(payload, DecodeStopReply, EncodeStopReply);
  RoundTrip(payload, DecodePublishBegin, EncodePublishBegin);
  RoundTrip(payload, DecodePublishCommit, EncodePublishCommit);
  RoundTrip(payload, DecodePublishCommitted, EncodePublishCommitted);
  if (auto plan = DecodePublishBegin(payload); plan.ok()) (void)ValidatePublishPlan(*plan);
  RoundTrip(payload, DecodeError, [](const ErrorReply& e) {
    return EncodeError(weightcache::Status(e.code, e.message));
  });
  (void)DecodeEmptyRequest(MessageType::kAttach, payload);
  auto manifest = Manifest::Decode(payload);
  if (manifest.ok()) CheckManifest(*manifest);
  (void)DecodeAttachReply(
      Frame{MessageType::kAttachReply, std::vector<uint8_t>(payload.begin(), payload.end()), {}});
  // The keeper handoff (handoff.h): without fds no deposit can be accepted.
  Check(!DecodeHandoff(
             Frame{MessageType::kDeposit, std::vector<uint8_t>(payload.begin(), payload.end()), {}})
             .ok());
  RoundTrip(payload, DecodeQueryReply, EncodeQueryReply);
  RoundTrip(payload, DecodeWithdraw, [](const std::string& d) { return EncodeWithdraw(d); });
}

void ReadAsStream(std::span<const uint8_t> data, Expect expect) {
  auto pair = weightcache::os::SocketPair(weightcache::os::Blocking::kNonBlocking);
  if (!pair.ok()) return;
  // Fits in the socket buffer: fuzz inputs are far below its ~200 KiB.
  if (data.empty() || !weightcache::os::SendSome(pair->first.get(), data, {}).ok()) return;
  pair->first.Reset();  // EOF after the data
  FrameReader reader(expect);
  for (int frames = 0; frames < 64; ++frames) {
    auto frame = reader.ReadAvailable(pair->second.get());
    if (!frame.ok() || !frame->has_value()) return;
    Check((*frame)->payload.size() <= MaxPayloadFor((*frame)->type));
    Check((*frame)->fds.empty());
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::span<const uint8_t> input(data, size);
  for (Expect expect :
       {Expect::kRequest, Expect::kReply, Expect::kKeeperRequest, Expect::kKeeperReply}) {
    auto header = DecodeFrameHeader(input, expect);
    if (header.ok()) {
      Check(header->payload_length <= MaxPayloadFor(header->type));
      Check(header->fd_count <= MaxFdsFor(header->type));
    }
  }
  if (size >= kFrameHeaderSize) DecodePayloadEverywhere(input.subspan(kFrameHeaderSize));
  DecodePayloadEverywhere(input);
  DecodeAsAttachReply(input);
  ReadAsStream(input, Expect::kRequest);
  ReadAsStream(input, Expect::kReply);
  ReadAsStream(input, Expect::kKeeperRequest);
  return 0;
}
