"""Can a VMM allocation be exported again from a process that imported it?

UCX's cuda_ipc (1.22) packs a remote key for VMM memory only when the pointer's
CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES has CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR (or
FABRIC); otherwise the key says "no IPC" and the peer copies through host staging. A fill
source serves an *imported* mapping of its arena (the daemon drops the load's own context and
mappings once ready), and on the H100 of 2026-12-05 the filler's UCX logged "unsupported key
handle type: 0" for it (docs/fleet.md, "The GPU run"). This probe prints, for an allocation
made here with cuMemCreate (POSIX fd handles) and for the same allocation imported from that
fd in a second process: the allowed handle types, whether it is legacy-IPC capable, and
whether cuMemRetainAllocationHandle + cuMemExportToShareableHandle(POSIX fd) succeed. It
does the same for the fd imported back into the first process once its own handle is released
(the daemon's case: it keeps only the fds), and checks that a sibling process may take the fd
with pidfd_getfd (what UCX's cuda_ipc does to open a peer's POSIX-fd key; Yama's ptrace_scope
decides it for non-root users).

    python3 bench/probes/vmm_export_probe.py      # on the GPU machine; nothing to build
"""
import ctypes as C
import os
import subprocess
import sys

cu = C.CDLL("libcuda.so.1")

# cuda.h values used here.
POSIX_FD = 1  # CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
ATTR_LEGACY_IPC = 10  # CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE
ATTR_ALLOWED_HANDLE_TYPES = 14  # CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES


class AllocationProp(C.Structure):  # CUmemAllocationProp
    _fields_ = [("type", C.c_int), ("handle_types", C.c_int), ("location_type", C.c_int),
                ("location_id", C.c_int), ("win32_metadata", C.c_void_p),
                ("compression", C.c_ubyte), ("rdma_capable", C.c_ubyte), ("usage", C.c_ushort),
                ("reserved", C.c_ubyte * 4)]


class AccessDesc(C.Structure):  # CUmemAccessDesc
    _fields_ = [("location_type", C.c_int), ("location_id", C.c_int), ("flags", C.c_int)]


def check(rc, what):
    if rc != 0:
        sys.exit(f"{what}: CUresult {rc}")


def init():
    check(cu.cuInit(0), "cuInit")
    dev = C.c_int()
    check(cu.cuDeviceGet(C.byref(dev), 0), "cuDeviceGet")
    ctx = C.c_void_p()
    check(cu.cuDevicePrimaryCtxRetain(C.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    check(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    prop = AllocationProp(type=1, handle_types=POSIX_FD, location_type=1, location_id=0)
    granularity = C.c_size_t()
    check(cu.cuMemGetAllocationGranularity(C.byref(granularity), C.byref(prop), 0),
          "cuMemGetAllocationGranularity")
    return prop, granularity.value * 16


def map_handle(handle, size):
    ptr = C.c_ulonglong()
    check(cu.cuMemAddressReserve(C.byref(ptr), C.c_size_t(size), C.c_size_t(0),
                                 C.c_ulonglong(0), C.c_ulonglong(0)), "cuMemAddressReserve")
    check(cu.cuMemMap(ptr, C.c_size_t(size), C.c_size_t(0), handle, C.c_ulonglong(0)),
          "cuMemMap")
    access = AccessDesc(location_type=1, location_id=0, flags=3)  # device 0, read-write
    check(cu.cuMemSetAccess(ptr, C.c_size_t(size), C.byref(access), C.c_size_t(1)),
          "cuMemSetAccess")
    return ptr


def report(name, ptr):
    allowed = C.c_ulonglong(0)
    allowed_rc = cu.cuPointerGetAttribute(C.byref(allowed), ATTR_ALLOWED_HANDLE_TYPES, ptr)
    legacy = C.c_int(0)
    legacy_rc = cu.cuPointerGetAttribute(C.byref(legacy), ATTR_LEGACY_IPC, ptr)
    handle = C.c_ulonglong()
    retain_rc = cu.cuMemRetainAllocationHandle(C.byref(handle), C.c_void_p(ptr.value))
    fd = C.c_int(-1)
    export_rc = (cu.cuMemExportToShareableHandle(C.byref(fd), handle, POSIX_FD, C.c_ulonglong(0))
                 if retain_rc == 0 else None)
    print(f"{name}: allowed handle types {allowed.value} (rc {allowed_rc}), legacy IPC "
          f"{legacy.value} (rc {legacy_rc}), retain rc {retain_rc}, export rc {export_rc}, "
          f"fd {fd.value}", flush=True)


def import_fd(fd):
    handle = C.c_ulonglong()
    check(cu.cuMemImportFromShareableHandle(C.byref(handle), C.c_void_p(fd), POSIX_FD),
          "cuMemImportFromShareableHandle")
    return handle


def pidfd_getfd_from(pid, fd):
    """The fd number taken from process `pid` with pidfd_getfd, or the errno as a string."""
    libc = C.CDLL(None, use_errno=True)
    sys_pidfd_open, sys_pidfd_getfd = 434, 438  # x86-64
    pidfd = libc.syscall(sys_pidfd_open, pid, 0)
    if pidfd < 0:
        return "pidfd_open: " + os.strerror(C.get_errno())
    taken = libc.syscall(sys_pidfd_getfd, pidfd, fd, 0)
    os.close(pidfd)
    return taken if taken >= 0 else "pidfd_getfd: " + os.strerror(C.get_errno())


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--getfd":  # a sibling: take the parent's fd
        pid, fd = int(sys.argv[2]), int(sys.argv[3])
        taken = pidfd_getfd_from(pid, fd)
        if isinstance(taken, str):
            print(f"sibling pidfd_getfd of the exported fd: {taken}", flush=True)
            return
        _, size = init()
        report("imported via pidfd_getfd (a third process)", map_handle(import_fd(taken), size))
        return
    prop, size = init()
    if len(sys.argv) > 1:  # the second process: import the first one's fd
        report("imported (another process)", map_handle(import_fd(int(sys.argv[1])), size))
        return
    handle = C.c_ulonglong()
    check(cu.cuMemCreate(C.byref(handle), C.c_size_t(size), C.byref(prop), C.c_ulonglong(0)),
          "cuMemCreate")
    fd = C.c_int()
    check(cu.cuMemExportToShareableHandle(C.byref(fd), handle, POSIX_FD, C.c_ulonglong(0)),
          "cuMemExportToShareableHandle")
    created = map_handle(handle, size)
    report("created (this process)", created)
    subprocess.run([sys.executable, __file__, str(fd.value)], pass_fds=[fd.value], check=True)
    try:
        scope = open("/proc/sys/kernel/yama/ptrace_scope").read().strip()
    except OSError:
        scope = "absent"
    print(f"uid {os.getuid()}, yama ptrace_scope {scope}", flush=True)
    subprocess.run([sys.executable, __file__, "--getfd", str(os.getpid()), str(fd.value)],
                   check=True)
    # The daemon's case: the creating handle and mapping released, only the fd kept.
    check(cu.cuMemUnmap(created, C.c_size_t(size)), "cuMemUnmap")
    check(cu.cuMemRelease(handle), "cuMemRelease")
    report("imported (this process, own handle released)", map_handle(import_fd(fd.value), size))


if __name__ == "__main__":
    main()
