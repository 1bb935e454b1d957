/* mpi_allreduce.c: MPI_Allreduce float32 SUM from 8 B to 64 MiB (doubling), the peer that
 * scripts/bench_coll.sh runs beside `ferroce all_reduce_perf` in the same run.
 *   mpirun -np N ./mpi_allreduce [iters-scale]
 * Out of place (send and receive buffers apart, as nccl-tests' out-of-place column), then in
 * place (MPI_IN_PLACE); warm-up, then a timed loop each; time per operation = the maximum over
 * ranks (ferroce all_reduce_perf -a 3). busbw = algbw * 2(n-1)/n (nccl-tests), GB/s = 1e9 B/s.
 * Both results are checked. Prints one line per size:
 * "RESULT <bytes> <time us> <busbw GB/s> <in-place time us> <in-place busbw GB/s>". */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank, n;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &n);
    double scale = argc > 1 ? atof(argv[1]) : 1.0;
    for (size_t bytes = 8; bytes <= (64u << 20); bytes *= 2) {
        size_t cnt = bytes / sizeof(float);
        float *a = malloc(bytes), *b = malloc(bytes);
        for (size_t i = 0; i < cnt; i++) a[i] = (float)((i * 7 + rank * 3) % 4 + 1);
        int iters = (int)(scale * (bytes <= 65536 ? 2000 : bytes <= (4u << 20) ? 100 : 10));
        if (iters < 1) iters = 1;
        for (int i = 0; i < (iters < 5 ? 1 : iters / 5); i++)
            MPI_Allreduce(a, b, (int)cnt, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        MPI_Barrier(MPI_COMM_WORLD);
        double t0 = MPI_Wtime();
        for (int i = 0; i < iters; i++)
            MPI_Allreduce(a, b, (int)cnt, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        double t = (MPI_Wtime() - t0) / iters, tmax;
        MPI_Allreduce(&t, &tmax, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
        for (size_t i = 0; i < cnt; i++) {
            float want = 0;
            for (int r = 0; r < n; r++) want += (float)((i * 7 + r * 3) % 4 + 1);
            if (b[i] != want) { fprintf(stderr, "wrong sum at %zu\n", i); MPI_Abort(MPI_COMM_WORLD, 1); }
        }
        /* In place (MPI_IN_PLACE): the values grow from one call to the next, which costs
         * nothing; one call on fresh input is checked after the loop. */
        MPI_Barrier(MPI_COMM_WORLD);
        t0 = MPI_Wtime();
        for (int i = 0; i < iters; i++)
            MPI_Allreduce(MPI_IN_PLACE, b, (int)cnt, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        double ti = (MPI_Wtime() - t0) / iters, timax;
        MPI_Allreduce(&ti, &timax, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
        for (size_t i = 0; i < cnt; i++) b[i] = a[i];
        MPI_Allreduce(MPI_IN_PLACE, b, (int)cnt, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        for (size_t i = 0; i < cnt; i++) {
            float want = 0;
            for (int r = 0; r < n; r++) want += (float)((i * 7 + r * 3) % 4 + 1);
            if (b[i] != want) { fprintf(stderr, "wrong in-place sum at %zu\n", i); MPI_Abort(MPI_COMM_WORLD, 1); }
        }
        double f = 2.0 * (n - 1) / n;
        if (rank == 0)
            printf("RESULT %zu %.2f %.3f %.2f %.3f\n", bytes, tmax * 1e6, bytes / tmax / 1e9 * f,
                   timax * 1e6, bytes / timax / 1e9 * f);
        free(a); free(b);
    }
    MPI_Finalize();
    return 0;
}
