// Stands in for glibc's <sys/single_threaded.h> (glibc 2.32 on). When that header exists,
// libstdc++'s reference counting reads glibc's __libc_single_threaded, the one symbol that would
// tie the binary to glibc 2.32 and its wheel to manylinux_2_34. With this one on the include path
// first, the answer is "not single-threaded": reference counts always use atomic operations,
// as they must in a training job anyway, and the binary needs nothing newer than glibc 2.28.
#pragma once

static const char __libc_single_threaded = 0;
