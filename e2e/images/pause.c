/* The pause program of rota's pause image: the process that holds a pod's namespaces.
 * It sleeps until SIGINT or SIGTERM (then exits 0) and reaps every child it inherits. */
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

static void quit(int sig) { (void)sig; _exit(0); }

static void reap(int sig) {
  (void)sig;
  while (waitpid(-1, NULL, WNOHANG) > 0) {
  }
}

int main(void) {
  struct sigaction stop = {.sa_handler = quit};
  struct sigaction child = {.sa_handler = reap, .sa_flags = SA_NOCLDSTOP | SA_RESTART};
  if (sigaction(SIGINT, &stop, NULL) || sigaction(SIGTERM, &stop, NULL) ||
      sigaction(SIGCHLD, &child, NULL)) {
    return 1;
  }
  for (;;) pause();
}
