// racecheck against the hand-off that Triton's lowering of warp specialisation compiles to (.ci/README.md,
// "Sanitizers"), written out in CUDA without Triton. There is no race in it: every access to the shared
// word is ordered by full-CTA barriers (barrier 1, all 256 threads). racecheck reports none, until the
// writing warpgroup also meets on its own at a counted barrier (`bar.sync N, 128`), which Triton emits
// inside every partition (before an mbarrier arrive, for instance): then it reports a hazard.
//
//   nvcc -gencode arch=compute_90a,code=sm_90a -o /tmp/handoff .ci/racecheck_counted_barrier.cu
//   compute-sanitizer --tool racecheck /tmp/handoff plain      # 0 hazards
//   compute-sanitizer --tool racecheck /tmp/handoff counted    # 1 hazard
#include <cstdio>
#include <cstring>

// Warpgroup 0 (the "default" warps) writes a word telling warpgroup 1 (the "workers") what to run, all
// meet at barrier 1, the workers read it, run, meet twice more, and the default warps write "exit".
// Registers move between the warpgroups with setmaxnreg, as in Triton's lowering.
template <bool COUNTED>
__global__ void __launch_bounds__(256, 1) handoff(int *out) {
  __shared__ int state;
  if (threadIdx.x / 128 == 0) {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 256;");
    if (threadIdx.x == 0) state = 42;  // "run partition 42"
    asm volatile("barrier.sync 1;" ::: "memory");
    asm volatile("barrier.sync 1;" ::: "memory");
    if (COUNTED) asm volatile("bar.sync 7, 128;" ::: "memory");  // this warpgroup alone
    asm volatile("barrier.sync 1;" ::: "memory");
    if (threadIdx.x == 0) state = 7;  // "exit"
    asm volatile("barrier.sync 1;" ::: "memory");
  } else {
    while (true) {
      asm volatile("barrier.sync 1;" ::: "memory");
      int s = *(volatile int *)&state;
      if (s == 7) break;
      asm volatile("setmaxnreg.dec.sync.aligned.u32 24;");
      asm volatile("barrier.sync 1;" ::: "memory");
      out[threadIdx.x] = s;  // the partition
      asm volatile("barrier.sync 1;" ::: "memory");
      asm volatile("setmaxnreg.inc.sync.aligned.u32 256;");
    }
  }
}

int main(int argc, char **argv) {
  bool counted = argc > 1 && !strcmp(argv[1], "counted");
  int *out, host[256];
  cudaMalloc(&out, sizeof(host));
  if (counted) handoff<true><<<8, 256>>>(out);
  else handoff<false><<<8, 256>>>(out);
  cudaMemcpy(host, out, sizeof(host), cudaMemcpyDeviceToHost);
  printf("%s: the workers read %d (%s)\n", counted ? "counted" : "plain", host[200],
         cudaGetErrorString(cudaGetLastError()));
  return host[200] != 42;
}
