#include "fleet/arena_transfer_hello.h"

#include <cstdio>
#include <string>

#include "protocol/wire.h"

namespace weightcache::fleet {
namespace wire = protocol::wire;

Result<std::vector<uint8_t>> EncodeHello(const Hello& hello) {
  if (hello.manifest.size() > kMaxManifestBytes) {
    return InvalidArgument("hello: the manifest blob is " + std::to_string(hello.manifest.size()) +
                           " bytes, over the bound of " + std::to_string(kMaxManifestBytes));
  }
  if (hello.regions.size() > kMaxHelloRegions) {
    return InvalidArgument("hello: " + std::to_string(hello.regions.size()) +
                           " regions, over the bound of " + std::to_string(kMaxHelloRegions));
  }
  std::vector<uint8_t> out;
  wire::PutU32(out, kHelloMagic);
  wire::PutU32(out, hello.version);
  wire::PutU64(out, 0);  // body_bytes, patched below
  wire::PutU64(out, hello.manifest.size());
  wire::PutU32(out, static_cast<uint32_t>(hello.regions.size()));
  wire::PutU32(out, static_cast<uint32_t>(hello.protocol));
  out.insert(out.end(), hello.manifest.begin(), hello.manifest.end());
  const bool ucx = hello.protocol == HelloProtocol::kUcx;
  for (const HelloRegion& region : hello.regions) {
    if (ucx && (region.rkey.empty() || region.rkey.size() > kMaxRkeyBytes)) {
      return InvalidArgument("hello: an rkey of " + std::to_string(region.rkey.size()) +
                             " bytes (1.." + std::to_string(kMaxRkeyBytes) + ")");
    }
    if (!ucx && (!region.rkey.empty() || region.remote_address != 0)) {
      return InvalidArgument("hello: an rkey or an address in a tcp-protocol hello");
    }
    if (region.bytes == 0 || region.bytes > kMaxRegionBytes) {
      return InvalidArgument("hello: a region of " + std::to_string(region.bytes) + " bytes");
    }
    wire::PutU64(out, region.remote_address);
    wire::PutU64(out, region.bytes);
    wire::PutU32(out, static_cast<uint32_t>(region.rkey.size()));
    out.insert(out.end(), region.rkey.begin(), region.rkey.end());
  }
  if (ucx) {
    if (hello.worker_address.empty() || hello.worker_address.size() > kMaxWorkerAddressBytes) {
      return InvalidArgument("hello: a worker address of " +
                             std::to_string(hello.worker_address.size()) + " bytes (1.." +
                             std::to_string(kMaxWorkerAddressBytes) + ")");
    }
    wire::PutU32(out, static_cast<uint32_t>(hello.worker_address.size()));
    out.insert(out.end(), hello.worker_address.begin(), hello.worker_address.end());
  } else if (!hello.worker_address.empty()) {
    return InvalidArgument("hello: a worker address in a tcp-protocol hello");
  }
  wire::SetU64(out, 8, out.size() - kHelloHeaderBytes);
  return out;
}

Result<uint64_t> DecodeHelloHeader(std::span<const uint8_t> header) {
  if (header.size() != kHelloHeaderBytes) {
    return ProtocolError("hello: a header of " + std::to_string(header.size()) + " bytes");
  }
  const uint32_t magic = wire::GetU32(header.data());
  if (magic == kRefusalMagic) {
    const uint32_t reason = wire::GetU32(header.data() + 4);
    if (reason == static_cast<uint32_t>(RefusalReason::kStopping)) {
      return Status(StatusCode::kUnavailable, "the source is stopping (it refused the connection)");
    }
    return Status(StatusCode::kUnavailable,
                  "the source is full (it refused the connection: as many peers connected as it "
                  "serves at once)");
  }
  if (magic != kHelloMagic) {
    return ProtocolError("hello: bad magic 0x" + [&] {
      char text[9];
      std::snprintf(text, sizeof(text), "%08x", magic);
      return std::string(text);
    }() + " (not a weightcache arena source)");
  }
  const uint32_t version = wire::GetU32(header.data() + 4);
  if (version != kHelloVersion) {
    return ProtocolError("hello: version " + std::to_string(version) + ", this build speaks " +
                         std::to_string(kHelloVersion));
  }
  const uint64_t body = wire::GetU64(header.data() + 8);
  if (body < 16 || body > kMaxHelloBodyBytes) {
    return ProtocolError("hello: a body of " + std::to_string(body) + " bytes (16.." +
                         std::to_string(kMaxHelloBodyBytes) + ")");
  }
  return body;
}

Result<Hello> DecodeHelloBody(std::span<const uint8_t> body) {
  size_t at = 0;
  auto need = [&](uint64_t n, const char* what) -> Status {
    if (n > body.size() - at) {
      return ProtocolError(std::string("hello: truncated at ") + what + " (offset " +
                           std::to_string(at) + ", " + std::to_string(body.size()) + " bytes)");
    }
    return Status::Ok();
  };
  WEIGHTCACHE_RETURN_IF_ERROR(need(16, "the counts"));
  const uint64_t manifest_bytes = wire::GetU64(body.data());
  const uint32_t region_count = wire::GetU32(body.data() + 8);
  const uint32_t protocol = wire::GetU32(body.data() + 12);
  at = 16;
  if (manifest_bytes > kMaxManifestBytes) {
    return ProtocolError("hello: a manifest of " + std::to_string(manifest_bytes) +
                         " bytes, over the bound of " + std::to_string(kMaxManifestBytes));
  }
  if (region_count == 0 || region_count > kMaxHelloRegions) {
    return ProtocolError("hello: " + std::to_string(region_count) + " regions (1.." +
                         std::to_string(kMaxHelloRegions) + ")");
  }
  if (protocol != static_cast<uint32_t>(HelloProtocol::kTcp) &&
      protocol != static_cast<uint32_t>(HelloProtocol::kUcx)) {
    return ProtocolError("hello: protocol " + std::to_string(protocol) + " (1 tcp, 2 ucx)");
  }
  Hello hello;
  hello.protocol = static_cast<HelloProtocol>(protocol);
  const bool ucx = hello.protocol == HelloProtocol::kUcx;
  WEIGHTCACHE_RETURN_IF_ERROR(need(manifest_bytes, "the manifest"));
  hello.manifest.assign(body.begin() + static_cast<ptrdiff_t>(at),
                        body.begin() + static_cast<ptrdiff_t>(at + manifest_bytes));
  at += manifest_bytes;
  hello.regions.reserve(region_count);
  uint64_t total = 0;
  for (uint32_t i = 0; i < region_count; ++i) {
    WEIGHTCACHE_RETURN_IF_ERROR(need(20, "a region"));
    HelloRegion region;
    region.remote_address = wire::GetU64(body.data() + at);
    region.bytes = wire::GetU64(body.data() + at + 8);
    const uint32_t rkey_bytes = wire::GetU32(body.data() + at + 16);
    at += 20;
    const std::string which = "hello: region " + std::to_string(i);
    if (region.bytes == 0 || region.bytes > kMaxRegionBytes) {
      return ProtocolError(which + " of " + std::to_string(region.bytes) + " bytes (1.." +
                           std::to_string(kMaxRegionBytes) + ")");
    }
    if (region.remote_address > UINT64_MAX - region.bytes) {
      return ProtocolError(which + ": its address range wraps around");
    }
    total += region.bytes;
    if (total > kMaxRegionBytes) {
      return ProtocolError("hello: the regions add up past " + std::to_string(kMaxRegionBytes));
    }
    if (!ucx && rkey_bytes != 0) {
      return ProtocolError(which + ": an rkey of " + std::to_string(rkey_bytes) +
                           " bytes (the tcp protocol has none)");
    }
    if (!ucx && region.remote_address != 0) {
      return ProtocolError(which + ": an address (the tcp protocol has none)");
    }
    if (ucx && (rkey_bytes == 0 || rkey_bytes > kMaxRkeyBytes)) {
      return ProtocolError(which + ": an rkey of " + std::to_string(rkey_bytes) + " bytes (1.." +
                           std::to_string(kMaxRkeyBytes) + ")");
    }
    WEIGHTCACHE_RETURN_IF_ERROR(need(rkey_bytes, "an rkey"));
    region.rkey.assign(body.begin() + static_cast<ptrdiff_t>(at),
                       body.begin() + static_cast<ptrdiff_t>(at + rkey_bytes));
    at += rkey_bytes;
    hello.regions.push_back(std::move(region));
  }
  if (ucx) {
    WEIGHTCACHE_RETURN_IF_ERROR(need(4, "the worker address"));
    const uint32_t address_bytes = wire::GetU32(body.data() + at);
    at += 4;
    if (address_bytes == 0 || address_bytes > kMaxWorkerAddressBytes) {
      return ProtocolError("hello: a worker address of " + std::to_string(address_bytes) +
                           " bytes (1.." + std::to_string(kMaxWorkerAddressBytes) + ")");
    }
    WEIGHTCACHE_RETURN_IF_ERROR(need(address_bytes, "the worker address"));
    hello.worker_address.assign(body.begin() + static_cast<ptrdiff_t>(at),
                                body.begin() + static_cast<ptrdiff_t>(at + address_bytes));
    at += address_bytes;
  }
  if (at != body.size()) {
    return ProtocolError("hello: " + std::to_string(body.size() - at) + " bytes past the " +
                         (ucx ? "worker address" : "last region"));
  }
  return hello;
}

std::vector<uint8_t> EncodeRefusal(RefusalReason reason) {
  std::vector<uint8_t> out;
  wire::PutU32(out, kRefusalMagic);
  wire::PutU32(out, static_cast<uint32_t>(reason));
  wire::PutU64(out, 0);
  return out;
}

std::vector<uint8_t> EncodeReadRequest(const ReadRequest& request) {
  std::vector<uint8_t> out;
  wire::PutU32(out, kOpRead);
  wire::PutU32(out, request.region);
  wire::PutU64(out, request.offset);
  wire::PutU64(out, request.length);
  return out;
}

Result<ReadRequest> DecodeReadRequest(std::span<const uint8_t> frame,
                                      std::span<const uint64_t> region_bytes) {
  if (frame.size() != kReadRequestBytes) {
    return ProtocolError("a read request of " + std::to_string(frame.size()) + " bytes");
  }
  const uint32_t opcode = wire::GetU32(frame.data());
  if (opcode != kOpRead) {
    return ProtocolError("opcode " + std::to_string(opcode) +
                         " (not a read: " + std::to_string(kOpRead) + " is the only one)");
  }
  ReadRequest request;
  request.region = wire::GetU32(frame.data() + 4);
  request.offset = wire::GetU64(frame.data() + 8);
  request.length = wire::GetU64(frame.data() + 16);
  if (request.region >= region_bytes.size()) {
    return ProtocolError("region " + std::to_string(request.region) + " of " +
                         std::to_string(region_bytes.size()));
  }
  if (request.length == 0 || request.length > kMaxReadBytes) {
    return ProtocolError("a length of " + std::to_string(request.length) + " (1.." +
                         std::to_string(kMaxReadBytes) + ")");
  }
  const uint64_t size = region_bytes[request.region];
  // Written so that it cannot wrap: length <= size is checked first.
  if (request.length > size || request.offset > size - request.length) {
    return ProtocolError("offset " + std::to_string(request.offset) + " + length " +
                         std::to_string(request.length) + " past region " +
                         std::to_string(request.region) + "'s " + std::to_string(size) + " bytes");
  }
  return request;
}

}  // namespace weightcache::fleet
