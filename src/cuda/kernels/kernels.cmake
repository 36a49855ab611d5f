# The GPU checksum kernel: nvcc → fatbin → a generated .cc holding the bytes, compiled into
# wc_cuda. Included from src/cuda/CMakeLists.txt. Needs nvcc only at build time; nothing links
# libcudart. With WEIGHTCACHE_BUILD_KERNELS=OFF (or no nvcc) the image is empty and
# GpuTensorChecksums returns kUnavailable.
set(WC_CHECKSUM_FATBIN_CC ${CMAKE_CURRENT_BINARY_DIR}/checksum_fatbin.cc)
set(WC_EMBED_SCRIPT ${CMAKE_CURRENT_SOURCE_DIR}/kernels/embed_fatbin.cmake)
if(WEIGHTCACHE_BUILD_KERNELS AND WEIGHTCACHE_HAVE_GPU AND CUDAToolkit_NVCC_EXECUTABLE)
  set(WC_CHECKSUM_FATBIN ${CMAKE_CURRENT_BINARY_DIR}/checksum.fatbin)
  add_custom_command(
    OUTPUT ${WC_CHECKSUM_FATBIN}
    COMMAND ${CUDAToolkit_NVCC_EXECUTABLE} --fatbin -O3 -std=c++17 -I${PROJECT_SOURCE_DIR}/src
            -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90
            -gencode arch=compute_90,code=compute_90
            -o ${WC_CHECKSUM_FATBIN} ${CMAKE_CURRENT_SOURCE_DIR}/kernels/checksum.cu
    DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/kernels/checksum.cu
            ${CMAKE_CURRENT_SOURCE_DIR}/kernels/xxh64_core.h
            ${CMAKE_CURRENT_SOURCE_DIR}/kernels/checksum_abi.h
    COMMENT "nvcc: checksum kernel fatbin (sm_80, sm_90, compute_90 PTX)"
    VERBATIM)
  add_custom_command(
    OUTPUT ${WC_CHECKSUM_FATBIN_CC}
    COMMAND ${CMAKE_COMMAND} -DINPUT=${WC_CHECKSUM_FATBIN} -DOUTPUT=${WC_CHECKSUM_FATBIN_CC}
            -P ${WC_EMBED_SCRIPT}
    DEPENDS ${WC_CHECKSUM_FATBIN} ${WC_EMBED_SCRIPT}
    COMMENT "Embedding the checksum fatbin"
    VERBATIM)
else()
  if(WEIGHTCACHE_BUILD_KERNELS AND WEIGHTCACHE_HAVE_GPU)
    message(STATUS "weightcache: nvcc not found; the GPU checksum kernel is not built")
  endif()
  add_custom_command(
    OUTPUT ${WC_CHECKSUM_FATBIN_CC}
    COMMAND ${CMAKE_COMMAND} -DOUTPUT=${WC_CHECKSUM_FATBIN_CC} -P ${WC_EMBED_SCRIPT}
    DEPENDS ${WC_EMBED_SCRIPT}
    VERBATIM)
endif()
target_sources(wc_cuda PRIVATE checksum_gpu.cc upload_pipeline.cc staging_ring.cc mapped_upload.cc ${WC_CHECKSUM_FATBIN_CC})
