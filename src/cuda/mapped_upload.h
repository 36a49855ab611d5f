// The mapped path of the upload pipeline (cuda/upload_pipeline.h, ReadMode::kMapped): the copy
// engine reads the page cache itself, with no CPU copy at all.
//
// Each source file is mapped read-only (os/file_mapping.h). The byte ranges the items need are
// cut into chunks of about `chunk_bytes` (page-aligned, disjoint: the driver refuses to register
// a page twice; a strided item's whole extent stays in one chunk, however large). Worker
// threads each take the next chunk, register it (cuMemHostRegister, READ_ONLY: the pages are
// the file's and are never written), issue its copies on a stream — cuMemcpyHtoDAsync for a
// contiguous piece, one cuMemcpy2DAsync for a strided item (source pitch = the row pitch in the
// file, destination pitch = the row's bytes) — record an event, and unregister a chunk only once
// its event completed, keeping `depth` chunks in flight each. Registering pins the pages (a page
// not yet cached is read in by the registration, one fault at a time: why kAuto takes this path
// only for files already in the page cache). The checksums are computed afterwards by the GPU
// checksum kernel over the device bytes (cuda/checksum_gpu.h, the same values as the host's
// TensorChecksum), so no CPU touches the bytes.
//
// Same contract as UploadPipeline::Run (synchronous; when it returns nothing it issued is in
// flight, every chunk is unregistered and every mapping gone; errors name the file and range).
#pragma once

#include <cuda.h>

#include <cstdint>
#include <span>
#include <vector>

#include "cuda/driver_api.h"
#include "cuda/upload_pipeline.h"
#include "cuda/upload_resources.h"
#include "weightcache/status.h"

namespace weightcache::cuda {

// The default chunk: 64 MiB, the size a probe on an H200 found fast (40 GB/s registered copies
// from the page cache); 256 registrations for 16 GB.
inline constexpr uint64_t kMappedChunkBytes = uint64_t{64} << 20;

// Whether the mapped path can run for these sources on the current context's device: the
// device registers read-only host memory (CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED),
// checksums, when asked for, have the GPU kernel, and every source is at least
// `min_residency` in the page cache. The reason when it cannot (for the log).
Status CheckMappedUpload(const DriverApi* api, std::span<const UploadSource> sources,
                         bool checksums, double min_residency);

// The checksums of the items' device bytes (TensorChecksum values), by the GPU kernel on
// `stream`, with `context` made current; after the copies into them completed.
Result<std::vector<uint64_t>> DeviceItemChecksums(const DriverApi* api, CUcontext context,
                                                  CUstream stream,
                                                  std::span<const UploadItem> items);

Result<UploadReport> RunMappedUpload(const DriverApi* api, CUcontext context,
                                     std::span<const CudaStream> streams,
                                     std::span<const UploadSource> sources,
                                     std::span<const UploadItem> items,
                                     const UploadOptions& options, const UploadControl& control,
                                     uint64_t total_bytes);

}  // namespace weightcache::cuda
