// libFuzzer target for the wire protocol decoders (protocol/frame.h, messages.h, manifest.h):
// everything a daemon or client parses from a peer. The input is treated as a frame header
// followed by a payload, as a bare payload for every payload decoder (the binary attach
// manifest included), and as a byte stream fed through FrameReader over a real socketpair.
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
#include "protocol/manifest.h"
#include "protocol/messages.h"

namespace {

using namespace weightcache::protocol;  // NOLINT: a fuzz target's one namespace

void Check(bool condition) {
  if (!condition) __builtin_trap();
}

void CheckManifest(const Manifest& m) {
  const auto& allocs = m.allocation_sizes();
  Check(allocs.size() <= kMaxFdsPerFrame);
  for (const TensorEntry& t : m.tensors()) {
    Check(!t.name.empty() && t.ndim <= kMaxTensorDims);
    Check(t.allocation < allocs.size());
    Check(t.offset <= allocs[t.allocation] && t.nbytes <= allocs[t.allocation] - t.offset);
  }
  // What was accepted encodes again (same checks), and decodes to the same table.
  auto again = EncodeManifest(m.tier(), allocs, m.tensors());
  Check(again.ok());
  auto back = Manifest::Decode(*again);
  Check(back.ok());
  Check(back->tensors().size() == m.tensors().size());
  for (size_t i = 0; i < m.tensors().size(); ++i) {
    const TensorEntry& a = m.tensors()[i];
    const TensorEntry& b = back->tensors()[i];
    Check(a.name == b.name && a.dtype == b.dtype && a.ndim == b.ndim && a.shape == b.shape &&
          a.allocation == b.allocation && a.offset == b.offset && a.nbytes == b.nbytes &&
          a.checksum == b.checksum);
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
  RoundTrip(payload, DecodeError, [](const ErrorReply& e) {
    return EncodeError(weightcache::Status(e.code, e.message));
  });
  (void)DecodeEmptyRequest(MessageType::kAttach, payload);
  auto manifest = Manifest::Decode(payload);
  if (manifest.ok()) CheckManifest(*manifest);
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
  for (Expect expect : {Expect::kRequest, Expect::kReply}) {
    auto header = DecodeFrameHeader(input, expect);
    if (header.ok()) {
      Check(header->payload_length <= MaxPayloadFor(header->type));
      Check(header->fd_count <= MaxFdsFor(header->type));
    }
  }
  if (size >= kFrameHeaderSize) DecodePayloadEverywhere(input.subspan(kFrameHeaderSize));
  DecodePayloadEverywhere(input);
  ReadAsStream(input, Expect::kRequest);
  ReadAsStream(input, Expect::kReply);
  return 0;
}
