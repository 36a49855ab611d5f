// segv_trace.so: LD_PRELOAD it into a test process to get the native frames of a crash
// (Python's faulthandler shows only the Python ones). On SIGSEGV/SIGBUS/SIGABRT/SIGILL/SIGFPE
// it writes, on an alternate stack (a stack overflow still reports), one line per frame:
// "segv_trace: #i <module> +0x<offset in module> <symbol>", which `addr2line -f -C -e <module>
// <offset>` turns into a file and line (scripts/gpu-python.sh does). Then the default action.
// Faulthandler, installed after it, runs first and chains to it.
#define _GNU_SOURCE
#include <dlfcn.h>
#include <execinfo.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

// The stderr the process started with, kept on a high fd: pytest's fd capture points fd 2 at a
// temporary file during each test, which a crashing process never copies out.
static int out_fd = 2;

static void on_fatal(int sig, siginfo_t* info, void* context) {
  (void)context;
  char line[1024];
  int n = snprintf(line, sizeof line, "segv_trace: signal %d at address %p\n", sig, info->si_addr);
  (void)!write(out_fd, line, (size_t)n);
  void* frames[64];
  const int count = backtrace(frames, 64);
  for (int i = 0; i < count; ++i) {
    Dl_info dl;
    memset(&dl, 0, sizeof dl);
    if (dladdr(frames[i], &dl) != 0 && dl.dli_fname != NULL) {
      n = snprintf(line, sizeof line, "segv_trace: #%d %s +0x%lx %s\n", i, dl.dli_fname,
                   (unsigned long)((char*)frames[i] - (char*)dl.dli_fbase),
                   dl.dli_sname != NULL ? dl.dli_sname : "?");
    } else {
      n = snprintf(line, sizeof line, "segv_trace: #%d ? %p\n", i, frames[i]);
    }
    if (n > 0) (void)!write(out_fd, line, (size_t)n < sizeof line ? (size_t)n : sizeof line - 1);
  }
  signal(sig, SIG_DFL);
  raise(sig);
}

__attribute__((constructor)) static void install(void) {
  const int kept = fcntl(2, F_DUPFD_CLOEXEC, 200);
  if (kept >= 0) out_fd = kept;
  static char alt[1 << 16];
  stack_t ss = {.ss_sp = alt, .ss_size = sizeof alt, .ss_flags = 0};
  sigaltstack(&ss, NULL);
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = on_fatal;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_RESETHAND;
  sigemptyset(&sa.sa_mask);
  const int sigs[] = {SIGSEGV, SIGBUS, SIGABRT, SIGILL, SIGFPE};
  for (size_t i = 0; i < sizeof sigs / sizeof sigs[0]; ++i) sigaction(sigs[i], &sa, NULL);
  void* warm[1];
  backtrace(warm, 1);  // loads libgcc_s now, not inside the handler
}
