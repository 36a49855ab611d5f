// listen_pid_exec PROGRAM ARGS... — what systemd does between its fork and the exec of a
// service that gets fds (sd_listen_fds(3)): LISTEN_PID is the pid of the process that will run
// PROGRAM, which only that process knows, so it sets it to its own pid and execs PROGRAM in
// place. The fds themselves (at 3…), LISTEN_FDS and LISTEN_FDNAMES come from the test that
// spawns this helper. Exit 127 when the exec fails.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: listen_pid_exec PROGRAM ARGS...\n");
    return 2;
  }
  const std::string pid = std::to_string(::getpid());
  if (::setenv("LISTEN_PID", pid.c_str(), 1) != 0) {
    std::perror("setenv LISTEN_PID");
    return 127;
  }
  ::execv(argv[1], argv + 1);
  std::perror(argv[1]);
  return 127;
}
