/*
 * weir pause: the sandbox ("infra") process of every pod on the local cluster (e2e/local/up).
 *
 * It holds the pod's namespaces open and does nothing else: it blocks in pause() until a
 * signal comes, exits 0 on SIGINT or SIGTERM, and reaps children on SIGCHLD (it is PID 1 of
 * the pod's PID namespace when the pod shares one, so orphans are re-parented to it).
 *
 * Build (static, so the image needs no libc):  gcc -static -O2 -o pause pause.c
 * `pause -v` prints the version and exits.
 */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#define WEIR_PAUSE_VERSION "1"

static volatile sig_atomic_t stop_requested;

static void on_stop(int sig) {
    (void)sig;
    stop_requested = 1;
}

static void on_child(int sig) {
    int saved = errno;
    (void)sig;
    /* Reap every child that has exited; more than one may be behind one SIGCHLD. */
    while (waitpid(-1, NULL, WNOHANG) > 0) {
    }
    errno = saved;
}

static int install(int sig, void (*handler)(int), int flags) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = handler;
    sa.sa_flags = flags;
    sigemptyset(&sa.sa_mask);
    return sigaction(sig, &sa, NULL);
}

int main(int argc, char **argv) {
    if (argc > 1 && strcmp(argv[1], "-v") == 0) {
        printf("weir-pause %s\n", WEIR_PAUSE_VERSION);
        return 0;
    }
    if (getpid() != 1) {
        /* Fine (the pod does not share its PID namespace), but worth a line in the logs. */
        fprintf(stderr, "weir-pause: running as pid %d, not as pid 1\n", (int)getpid());
    }
    if (install(SIGINT, on_stop, 0) != 0 || install(SIGTERM, on_stop, 0) != 0 ||
        install(SIGCHLD, on_child, SA_NOCLDSTOP | SA_RESTART) != 0) {
        perror("weir-pause: sigaction");
        return 1;
    }
    while (!stop_requested) {
        pause(); /* returns after each handled signal */
    }
    fprintf(stderr, "weir-pause: stopping\n");
    return 0;
}
