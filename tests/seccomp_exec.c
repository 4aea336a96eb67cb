/* seccomp_exec SYSCALL[,SYSCALL...] -- CMD ARGS...
 *
 * Runs CMD under a seccomp filter that answers the named NUMA system calls with
 * EPERM, as a container's seccomp profile does (Docker's default one without
 * CAP_SYS_NICE); a name followed by ":ENOSYS" is answered with ENOSYS instead, as
 * a kernel built without NUMA answers. Names: set_mempolicy, get_mempolicy, mbind,
 * migrate_pages, move_pages, set_mempolicy_home_node. Built by the tests with the
 * system cc; x86-64 only.
 *
 * Docker's default profile (moby/profiles seccomp/default.json) allows get_mempolicy,
 * mbind, set_mempolicy and set_mempolicy_home_node only with CAP_SYS_NICE, and never
 * move_pages or migrate_pages: all of them answer EPERM in a plain `docker run`.
 * As there, CMD runs without CAP_SYS_NICE (dropped from the bounding set, so that a
 * root CMD does not get it back at exec; nothing to drop for other users).
 */
#include <errno.h>
#include <linux/capability.h>
#include <linux/audit.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>

#ifndef SYS_set_mempolicy_home_node
#define SYS_set_mempolicy_home_node 450 /* x86-64, Linux 5.17+ */
#endif

static long number_of(const char *name) {
    if (!strcmp(name, "set_mempolicy")) return SYS_set_mempolicy;
    if (!strcmp(name, "get_mempolicy")) return SYS_get_mempolicy;
    if (!strcmp(name, "mbind")) return SYS_mbind;
    if (!strcmp(name, "migrate_pages")) return SYS_migrate_pages;
    if (!strcmp(name, "move_pages")) return SYS_move_pages;
    if (!strcmp(name, "set_mempolicy_home_node")) return SYS_set_mempolicy_home_node;
    return -1;
}

int main(int argc, char **argv) {
    struct sock_filter filter[32];
    unsigned n = 0;
    char names[256];
    if (argc < 4 || strcmp(argv[2], "--")) {
        fprintf(stderr, "usage: seccomp_exec SYSCALL[,SYSCALL...] -- CMD ARGS...\n");
        return 2;
    }
    filter[n++] = (struct sock_filter)BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, arch));
    filter[n++] = (struct sock_filter)BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, AUDIT_ARCH_X86_64, 1, 0);
    filter[n++] = (struct sock_filter)BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW);
    filter[n++] = (struct sock_filter)BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr));
    snprintf(names, sizeof names, "%s", argv[1]);
    for (char *name = strtok(names, ","); name && n < 28; name = strtok(NULL, ",")) {
        char *answer = strchr(name, ':');
        int error = EPERM;
        if (answer) {
            *answer++ = '\0';
            if (strcmp(answer, "ENOSYS")) {
                fprintf(stderr, "seccomp_exec: unknown answer %s\n", answer);
                return 2;
            }
            error = ENOSYS;
        }
        long nr = number_of(name);
        if (nr < 0) {
            fprintf(stderr, "seccomp_exec: unknown system call %s\n", name);
            return 2;
        }
        filter[n++] = (struct sock_filter)BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, nr, 0, 1);
        filter[n++] = (struct sock_filter)BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | error);
    }
    filter[n++] = (struct sock_filter)BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW);
    struct sock_fprog program = {.len = n, .filter = filter};
    if (prctl(PR_CAPBSET_DROP, CAP_SYS_NICE, 0, 0, 0) && errno != EPERM) {
        perror("seccomp_exec: PR_CAPBSET_DROP");
        return 2;
    }
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) || prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &program)) {
        perror("seccomp_exec: prctl");
        return 2;
    }
    execvp(argv[3], argv + 3);
    perror("seccomp_exec: execvp");
    return 127;
}
