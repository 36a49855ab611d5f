"""Can a VMM allocation be exported again from a process that imported it?

UCX's cuda_ipc (1.22) packs a remote key for VMM memory only when the pointer's
CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES has CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR (or
FABRIC); otherwise the key says "no IPC" and the peer copies through host staging. A fill
source serves an *imported* mapping of its arena (the daemon drops the load's own context and
mappings once ready), and on the H100 of 2026-12-05 the filler's UCX logged "unsupported key
handle type: 0" for it (docs/fleet.md, "The GPU run"). This probe prints, for an allocation
made here with cuMemCreate (POSIX fd handles) and for the same allocation imported from that
fd in a second process: the allowed handle types, whether it is legacy-IPC capable, and
whether cuMemRetainAllocationHandle + cuMemExportToShareableHandle(POSIX fd) succeed.

    python3 bench/probes/vmm_export_probe.py      # on the GPU machine; nothing to build
"""
import ctypes as C, os, sys, subprocess
cu = C.CDLL("libcuda.so.1")
def ck(r, w):
    if r: print(w, "->", r)
class Prop(C.Structure):
    _fields_ = [("type", C.c_int), ("htype", C.c_int), ("ltype", C.c_int), ("lid", C.c_int),
                ("win", C.c_void_p), ("comp", C.c_ubyte), ("rdma", C.c_ubyte), ("usage", C.c_ushort), ("res", C.c_ubyte * 4)]
class Acc(C.Structure):
    _fields_ = [("ltype", C.c_int), ("lid", C.c_int), ("flags", C.c_int)]
ck(cu.cuInit(0), "init")
dev = C.c_int(); ck(cu.cuDeviceGet(C.byref(dev), 0), "dev")
ctx = C.c_void_p(); ck(cu.cuDevicePrimaryCtxRetain(C.byref(ctx), dev), "retain"); ck(cu.cuCtxSetCurrent(ctx), "set")
p = Prop(type=1, htype=1, ltype=1, lid=0)
gran = C.c_size_t(); cu.cuMemGetAllocationGranularity(C.byref(gran), C.byref(p), 0)
size = gran.value * 16
def mapit(handle):
    ptr = C.c_ulonglong()
    ck(cu.cuMemAddressReserve(C.byref(ptr), C.c_size_t(size), C.c_size_t(0), C.c_ulonglong(0), C.c_ulonglong(0)), "reserve")
    ck(cu.cuMemMap(ptr, C.c_size_t(size), C.c_size_t(0), handle, C.c_ulonglong(0)), "map")
    acc = Acc(1, 0, 3); ck(cu.cuMemSetAccess(ptr, C.c_size_t(size), C.byref(acc), C.c_size_t(1)), "access")
    return ptr
def probe(name, ptr):
    a = C.c_ulonglong(0); r = cu.cuPointerGetAttribute(C.byref(a), 14, ptr)
    leg = C.c_int(0); rl = cu.cuPointerGetAttribute(C.byref(leg), 10, ptr)
    rh = C.c_ulonglong(); r2 = cu.cuMemRetainAllocationHandle(C.byref(rh), C.c_void_p(ptr.value))
    f = C.c_int(-1); r3 = cu.cuMemExportToShareableHandle(C.byref(f), rh, 1, C.c_ulonglong(0)) if r2 == 0 else -1
    print(name, "allowed_handle_types rc", r, "value", a.value, "legacy", rl, leg.value, "retain rc", r2, "export rc", r3, "fd", f.value, flush=True)
if len(sys.argv) > 1:
    h2 = C.c_ulonglong(); ck(cu.cuMemImportFromShareableHandle(C.byref(h2), C.c_void_p(int(sys.argv[1])), 1), "import")
    probe("imported (other process)", mapit(h2))
    sys.exit(0)
h = C.c_ulonglong(); ck(cu.cuMemCreate(C.byref(h), C.c_size_t(size), C.byref(p), C.c_ulonglong(0)), "create")
fd = C.c_int(); ck(cu.cuMemExportToShareableHandle(C.byref(fd), h, 1, C.c_ulonglong(0)), "export")
probe("created", mapit(h))
subprocess.run([sys.executable, __file__, str(fd.value)], pass_fds=[fd.value])
