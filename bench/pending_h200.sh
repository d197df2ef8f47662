#!/usr/bin/env bash
# The H200 measurements the open issues still owe, in priority order, each under its own time
# limit so one slow step cannot cost the rest. Every script writes its JSON under $OUT.
# A bare machine first needs `source bench/h200_setup.sh` (wheels, the embedded GGUF, kvtier).
# Each group fits one device call (10 min); give the call a timeout ~30 s over the group's sum.
#
#   bash bench/pending_h200.sh 1   # (~9 min) the user paths: gpu_smoke's generate checks, a model
#                                  #   at a time, 4 at once; then, in the next call, group 64
#   bash bench/pending_h200.sh 64  # (~5 min) gpu_smoke's plan, eval and serve checks; the CUDA
#                                  #   checks incl. CPU-attention rows
#   bash bench/pending_h200.sh 2   # (~7 min) issue 18: serve_gpu whole-GPU cases, where a decode
#                                  #   step's time goes (serve_profile, fused and separate projections)
#   bash bench/pending_h200.sh 3   # (~9 min) issue 18 under 24 GiB: c32, mixed (256K tiered + 32
#                                  #   streams), prefix; issue 20's HF cache bench
#   bash bench/pending_h200.sh 4   # (~9 min, after 1: it writes the 8B folder) issue 23 CPU
#                                  #   attention, issue 21 Gemma-2-9B, issue 19 needle recall
#   bash bench/pending_h200.sh 5   # (~5 min; ran 2026-12-01 late at f1dbcc6) issue 18: copy-engine
#                                  #   contention, mixed/prefix under 24 GiB with diagnostics, the
#                                  #   two-copy decode step and per-batch splits, a prefill profile
#   bash bench/pending_h200.sh 6   # (~6 min; ran 2026-12-02 at 716554e) what had no GPU run: the
#                                  #   tiered launcher thread and batched host-tier prefix loads
#                                  #   (mixed, prefix), hf_cache 128K planned for HF's forward (issue
#                                  #   20), gpu_checks seeded (blocks rows), CPU attention threads;
#                                  #   then group 1 again (gpu_smoke: GPU-facing code changed since)
#   bash bench/pending_h200.sh 7   # (~7 min; ran 2026-12-02 at c8b4a00) issue 23 lossless decode with CPU attention
#                                  #   at 128K and 512K (measured preset), issue 18 under 24 GiB with the
#                                  #   store built and freed off the loop and run-wise host-tier loads
#   bash bench/pending_h200.sh 8   # (~6 min; ran at c8b4a00) HF's cache at 128K beside HF's offloaded cache and
#                                  #   kvtier's runner (issue 20); the mixed case with 32 CUDA connections
#   bash bench/pending_h200.sh 9   # (~8 min) NEXT: issue 18 under 24 GiB (batched host-tier saves,
#                                  #   the paced launcher and unpaced beside it, pinned memory kept for
#                                  #   the next run, allocator counts of each slow batch step); issue 23
#                                  #   CPU-slice counts beside the planner's at 128K
#   then group 1 (gpu_smoke: the store is built, paced and freed on the launcher thread, host-tier
#   loads and saves copy runs of slots), then:
#   bash bench/pending_h200.sh 10  # (~7 min) issue 23 counts at 512K; issue 21 Gemma-2-9B at 640K
#   bash bench/pending_h200.sh 11  # (~4 min) issue 21 DeepSeek-V2-Lite at 128K, 1M and 2M under 24 GiB
#                                  #   (its routed experts in pinned host memory, --experts auto)
# The 2026-12-02 (eighth) session: groups 9, 10 ran at b7512d8; then, after the GGUF's two halves,
#   bash bench/pending_h200.sh 13  # (~5 min) gpu_smoke generate part + gpu_checks (MoE row)
#   bash bench/pending_h200.sh 12  # (~9 min) gpu_smoke plan/eval/serve part, group 11, and issue
#                                  #   23's planner with a third staging buffer at 128K and 512K
# The 2026-12-02 (ninth) session ran 15 (DeepSeek 2M; 14's rows failed in the bench's warm-up,
#   fixed), 14, then after the GGUF 16 and 17 at ca60c94, an A/B of the pool layouts, gpu_checks.
#   NEXT: group 18 (lent pages under 24 GiB; the paged-decode kernel's split counts and page
#   layouts alone), 20 (the allocator's cache freed after the long prefill), then group 19 after
#   the GGUF (expandable segments; the smoke's generate part). 18 and 20 run without the GGUF.
# The eleventh session ran 18 at 48c4e3a, then its own calls (flash prefill, deferred write-backs).
# The twelfth ran 25 (in place of 21 and 23), 22 (the whole smoke, 69/69), 27 (24 reordered), 28
#   (the mixed case unprofiled: met), a c64-1k-out with and without a tokenizer, then ran out.
# The thirteenth ran 31 (a3082cd-era: host work per serve step), then, after three refused starts,
#   35 and 32 (issue 19 on CUDA) and the embedded model's smoke alone (26/26), at b2d667c.
# The fourteenth ran 38 (after four refused starts) at 5170bf8, then, after two more, 39 with the
#   GGUF's first half, the whole smoke (22, its generate part cut at 290 s; the embedded model's
#   generate part then alone: 77 of 77 in all) and 40 (HAYSTACKS=prose) at 1674768.
# The fifteenth ran 41, 40 (repeat), the 16K cells and pass key, bench/batched_prefill.py, the
#   128K row of 34, 4K/8K prose, the embedded smoke and HiP variants on prose (preset lean), at
#   571d843-524b73d. NEXT (the sixteenth): the GGUF's two-call setup, then `lean` on the rest of
#   the grid (43: repeat 16K/32K, 4K/8K, RULER 16K, its speed; its last line also times HiP decode
#   after 5c43792, whose CPU operator count fell 38% at 16K), 42 (1M HiP over int4;
#   hip_cli_speed needs the GGUF for its tokenizer), 34's 512K row, 37 (RULER), 33, the smoke.
# The sixteenth ran 42's 1M row (with the GGUF's first half), the embedded smoke and 43 (all but
#   RULER's dense half, run apart), 42's CLI row, RULER dense 4K, and after --hip-preset auto the
#   embedded smoke again, NIAH 4K/8K prose under `hip` and the CLI's `hip` at 128K, at
#   ca9057c-8cfc525. NEXT (the seventeenth): the GGUF's two-call setup, then 44 (the CLI's
#   presets at 128K, twice; RULER 16K lean vs long x10), 34's 512K row (no GGUF), 33's 512K
#   (hip_cli_speed --contexts 512K --methods "auto;hip;hip,hip_preset=fast": past Llama-3.1's
#   128K `auto` runs lean, whose speed there is unmeasured), 29's sampled case. Group 45 (issue
#   23's packed kernel and split; no GGUF) can go first, in the call that carries the GGUF's
#   first half.
# The seventeenth ran 45 (with the GGUF's first half), the embedded smoke, 44's CLI row and RULER
#   lean x10, then after the fp8 unpack fix (c394132) fp8 at 512K, the smoke again and the CLI's
#   presets twice (the 128K prefill gap was Triton compiling in a machine's first HiP process).
#   NEXT (the eighteenth): the GGUF's two-call setup, then 46 (the smoke's serve part: HiP and
#   Quest requests now borrow pool pages, Quest plans its page bounds), 47 (33's 512K through the
#   CLI, alone in its call: the lossless run overran 200 s), 48 (pass key and RULER `long`), 34's
#   512K row, 29's sampled case.
# The eighteenth ran 34's 512K row, 46 (28/28 + 27/27), 48's pass key (0/10 dense at 4K: the
#   question, fixed in d616a67) and 47 (lossless 512K through the CLI; HiP cut by the call's
#   limit; `lean` half of `fast` at 160K, fixed in a11cdab), at f9629cd. NEXT (the nineteenth):
#   the GGUF's two-call setup, then 49 (HiP at 512K and 160K through the CLI after a11cdab; 128K
#   chunk sizes), 50 (pass key with the new question; RULER `long`), then 46 (the smoke: evicting
#   stores now grow only up to their capacity, Duo is planned with compact slices, KVPlan moved).
# The nineteenth lost its device results with its checkout. The twentieth ran 46 (28/28 + 27/27),
#   49 and 50 at 20e2632, then found HiP's 512K OOM (fixed in c592dce). NEXT: group 51 (GGUF's
#   two-call setup first), alone in its call: on a fresh machine the model folder and prompts
#   take ~1 min before the warm-up, and 250 s was not enough; then 52 (lean's speed at 160K with
#   the smaller pruning batches).
# The twenty-first ran 51 and 52 at 99556c2 (512K runs; lean's 160K prefill 30% slower), batched
#   each pruning stage on its own bytes, and ran 53, 54 and the smoke's serve part at 5f5d2dd
#   (all passed). NEXT: 56 with the GGUF's first half (call A), then 55 (call B), then 57, then
#   the smoke (group 1: GPU-facing code changed after 5f5d2dd: step timer, --hip-refresh, the
#   torch bisection's layout, the pruning bound moved).
# The twenty-second ran 56 (with the GGUF's first half), 55, 57 and the whole smoke (54/54 +
#   28/28) at 17115b0, then after 07ef87e (a refresh's missed runs in one fetch; lean's stage 0
#   every 32 steps) 58's first row (512K: 9.05 tok/s over 64 tokens) at a fresh start; its NIAH
#   row was cut (the GGUF's one-time conversion) and the device time ran out. NEXT: the GGUF's
#   two-call setup, then the smoke (group 1: GPU-facing code changed in 07ef87e), then 58's NIAH
#   and last rows (the NIAH grid of the default `hip` with lean's 32/8/4; the fetch fix alone),
#   59 (1M HiP over int4 with the batched fetch; no GGUF: it can go in call A).
# The twenty-third ran 59 (with the GGUF's first half), the smoke (group 1: the embedded model's
#   generate checks cut after 2 of 26 by the 280 s limit on a fresh machine; now 330 s) and 58's
#   rows at 9fcd0cb, then profiles (stage-1 reruns, one stream's step) and 60 after c6980e4 and
#   3470185 (the serve_gpu row needs .whl: `source bench/h200_setup.sh` first). NEXT: the GGUF's
#   two-call setup, then the smoke (group 1: GPU-facing code changed in c6980e4, 3470185 and
#   a2ebbe9, RoPE's torch path for 256+ rows: fp32 on CUDA),
#   then 61 (1M over int4 with the one-launch host gather and a profile of each kind of step;
#   512K through the CLI, 9.05 tok/s before), then 62 (128K: the plan's chunk against 8K, A/B).
# The twenty-fourth ran 61's 1M row with the GGUF's first half, the smoke (group 1 as it was: its
#   generate part cut after 49 of 54; the embedded model's then alone, 27/27), 61's 512K row and
#   62 at e85b67e, serve c1/c1-32k/c16/c64. NEXT: the GGUF's first half with group 63 (1M, no
#   GGUF) in call A; group 1 (the smoke's generate part, a model at a time: GPU-facing code
#   changed in this session's decode scoring slabs) in call B; then 64 (plan, eval, serve;
#   gpu_checks) and 65 (512K through the CLI).
# The twenty-fifth had no device. It cut the block cache's syncs (0796521: GPU-facing, so the
#   smoke is owed) and built stage-0 reruns scored on host keys (8bf13d8, `host_scoring`, off).
#   NEXT: as the twenty-fourth's NEXT (63 in call A, 1 in call B, then 64, 65), then 66 (the
#   host-scoring A/B at 512K; no GGUF) and 67 (the same through the CLI, `--hip-host-keys on`,
#   right after 65), 68 (128K A/B through the CLI), 69 (1M with host keys, after 63): if the
#   decode rates rise and the peaks hold under 24 GiB, make host keys the default.
# The twenty-sixth had no device either. Its GPU-facing changes are in the server's memory:
#   evictor, head-sparsity and quantized stores now take their slices and packed rows from lent
#   pool pages (dda1386, e55e696, 367af86), SnapKV plans its new tokens. The smoke's serve part
#   (64) covers int8, window and snapkv requests beside a batch. In its last half hour a device
#   came: 66, 1, 64 and 67 ran at b0c523e (all green; host keys 17.35 tok/s at 512K); 65 on a
#   fresh start ran past its 240 s (the 8B folder first). NEXT: 65 right after 67 on one warm
#   machine (the same-start A/B), then 63 (call A), 68, 69.
# The twenty-seventh ran 69 (OOM: SliceReader.keys over int4 unpacked a slab whole; fixed), 67 then
#   65 on one warm start (host keys 8.89 vs 5.71 tok/s at 512K), 68 (128K: 0.85x) and 63 (1M int4
#   0.349 s/token) at 3a6ab57, then made `--hip-host-keys auto` the default (on from 256K without
#   --kv-quant), and put HiP's block caches of a served request in its lent pages (GPU-facing:
#   the smoke's serve part now sends a streaming HiP request beside the batch). NEXT: the smoke
#   (the GGUF's two-call setup with group 1, then 64), 69 again (after the fix; no GGUF), and 70
#   (512K through the CLI with the default, recording the start's link and host-read rates, to
#   explain the 17.35 vs 8.89 tok/s of two starts), 71 (issue 23: AVX-512 4-bit rows on the host).
# The twenty-eighth had no device (one refused start, then none lent). Its GPU-facing changes:
#   Quest's page bounds preallocated per slice and placed in a served request's lent pages, HiP's
#   RoPE table and decode rows placed there too (one arena a slice with its bank), the pool
#   compacted before a run is planned (pages copied on the batch's stream), and HiP's torch
#   bisection tiled on the CPU (CUDA runs Triton's; the torch path's relative probes no longer
#   gather table rows). The smoke's serve part now sends a streaming Quest request beside the
#   batch. NEXT: as the twenty-seventh's: 71 with the GGUF's first half (call A), 1 (call B), 64, 70, 69;
#   then 72 and 73 (the mixed case with the long request naming HiP, then Quest: no GGUF).
# The twenty-ninth had no device ("none lent"). Its GPU-facing changes: a layer's CPU-attended
#   slices merge in one batch, their results crossing in one asynchronous copy from pinned
#   memory (a pageable copy per slice had synchronized the host every layer); a request whose
#   method drops nothing at its length (HiP under 3,328 tokens) runs lossless on CUDA, so the
#   smoke's HiP rows now take a 4.4K-token prompt and one row checks the short prompt ran
#   lossless; Quest's offloaded decode reads its selected pages with the GPU (host_gather) in
#   shapes that need no host sync; per-step index tensors made from host lists (the batch
#   engine's mixed steps, paged decode tables, prefix-cache pages, packed run reads, the eager
#   forward's last-token index) are copied non-blocking instead of waiting for the stream. NEXT: as the twenty-eighth's (71 with the GGUF's first half,
#   1, 64, 70, 69, 72, 73), with 74 after 71 and 75 (Quest at 512K over structured KV).
# The thirtieth ran 71 (with the GGUF's first half), 1, 64 + 74, 75 + 70 at 182bb02: the smoke's
#   serve part failed one check (a 304-token HiP request on the 8B model under 24 GiB: HiP's
#   preset-sized decode memory over the offload reserve; fixed: HiP's caches are bounded by the
#   request, and a request that fits nowhere else borrows what the batch's keep withheld).
#   GPU-facing since: HipConfig.capacity (the kernel's caches and decode rows), stopgap block
#   caches of 6K/4K tokens (only where nothing else fits), the serve fallback, windowed models
#   lending, auto's slicing by the CPU split. NEXT: call A carries .gguf_a and runs
#   `mkdir -p /tmp/gg && cp .gguf_a/gguf_part_aa /tmp/gg/ && export PYTHONPATH=. PYTHONUNBUFFERED=1
#   && bash bench/pending_h200.sh 77`; call B, at once, carries .whl and .gguf_b: the smoke
#   (group 1), then 64; then 72 (the mixed case with HiP at 256K: by the planner it now fits
#   with a 4K stopgap cache and 659 lent pages), 76, 73, 69.
# The thirty-first got no H200; on an H100 it ran 77 (ran out of memory after a 128K HiP request:
#   fixed, ServeEngine.held_by_stores and tiered.detached), 1 and 64 (85/85 at 1647454), 77 again
#   (7/7 at ede2f51), 72 (HiP 256K beside 32 streams: 1.005 s/token, one-head slices with a
#   stopgap cache) and 72 with --offload-reserve 4GiB (0.427 s/token, four-head slices). GPU-facing
#   since the smoke: the serve changes above, a request waits for an own store in the batch, the
#   placement log. NEXT (on an H200): call A carries .gguf_a and .whl (56 MB): `mkdir -p /tmp/gg
#   && cp .gguf_a/gguf_part_aa /tmp/gg/ && source bench/h200_setup.sh >/dev/null 2>&1 && bash
#   bench/pending_h200.sh 78`; call B, at once, carries .whl and .gguf_b: the smoke (1, then 64);
#   then 76 (issue 23), 73, 69.
# The thirty-second session ran 79 (76's first and third rows), the smoke (1, 64: 29+28+26, the
#   last two serve checks cut by the then 220 s limit), 78 (both rows), 81 and 82 (on an H100).
#   NEXT: 84 alone in a call (~9 min; the A/B of --unpack-stream on one start), then 83 (auto's
#   slicing over int4), the smoke (the GGUF's two calls: kvtier/ changed after it: the planner's
#   int4 slicing and unpack model, StoreOptions.unpack_stream), 80, 73, 69.
# The thirty-third session got no device (every start refused, then none lent): all of the above
#   is still owed, then 85 (~7 min: probe scoring's A/B at 512K, HiP's stage-0 reruns), and after
#   the GGUF 86 (the same through the CLI) and 87 (its NIAH on CUDA): if 86 wins and 87 holds,
#   make --hip-probes the default.
# The thirty-fourth session spent ~1,100 s of its budget on refused starts, then got an H100 for
#   the rest at 1c3d349: 91 (the new decode kernel's CUDA tests, 60 passed; 84's traced pair:
#   --unpack-stream 0.367 -> 0.318 s/token), 89 (embedded smoke 28/28 + 15/15), 88's A/B twice
#   at 16 layers (plain steps 31.9 -> 12.8 ms), gpu_checks (all pass). NEXT: 84's CPU-slice pair
#   (does --unpack-stream win with CPU slices too?), 85, 86, 87 (probes: speed, CLI, NIAH), 92
#   (1M through the CLI with probes: issue 19's 20 tok/s), the 8B model's smoke (1's first row,
#   then 64), then 83, 80, 73, 69.
# The thirty-fifth session got a machine only at its end (every start refused for two and a half
#   hours, ~1,300 s of the budget spent on refusals): on an H100, 93's rows bench and CPU-slice
#   pair (0.283 s/token; the unpack stream beside it 0.307) and gpu_checks (all pass), at 1d58fba. Built on the CPU: the packed rows' CPU kernel prefetches the next
#   row (int4 1 thread 2.08 -> 2.76 M tokens/s here), the planner weighs the unpack stream beside
#   CPU slices. NEXT: call A carries .gguf_a and .whl and runs 93's last row (SmolLM2's HiP prefill
#   profile; its first rows ran); call
#   B at once carries .whl and .gguf_b and runs 89 (the embedded smoke: the store and LLM were
#   split into modules since the last smoke); then 92 (1M through the CLI), 85, 86, 87, the 8B
#   model's smoke (1's first row, then 64), 83, 80, 73, 69.
# The thirty-sixth got an H100 for one start after ~600 s of refused ones (ed334d1): 94's first
#   row (SmolLM2's HiP prefill profiled: the softmax head score's torch passes ~200 ms and stage
#   2's bisection 174 ms of 0.68 s; its 512K lean/fast prefill rows were cut by the limit), 89
#   (the embedded smoke, 28/28 + 15/15) and gpu_checks twice (after the C++ split too). Then, on
#   the CPU, HiP's pruning kernels changed (the softmax head score in Triton, the bisection's
#   rows written whole at level 0 and tiled where not a power of two). NEXT: call A with the
#   GGUF's first half runs 95 (their speed), call B runs 89 (the smoke: GPU-facing code changed);
#   then 96 (94's 512K rows alone), 92, 85, 86, 87, the 8B smoke, 83, 80, 73, 69.
# The thirty-seventh got an H100 at once (830eb89): 95 (lean 0.124x dense, now launch-bound),
#   89 (28/28 + 15/15), 96, 92 (1M int4 + probes: the bisection failed to compile; fixed in
#   d5f16d9, the rerun ran out of device time). Then, on the CPU, the pruning's launches cut
#   (rotation hoisted, whole-chunk batches where the plan has room). NEXT: call A with the GGUF's
#   first half runs 97 (SmolLM2's prefill after it), call B runs 98 (the smoke), then 99 (1M on
#   the same machine: the prompt needs the GGUF), 100 (512K's prefill steps through the CLI),
#   101 (--hip-strides 4/4/2: speed and NIAH), 85, 86, 87, the 8B smoke, 83, 80, 73, 69.
# The thirty-eighth got an H100 at once (e552b94): 97 (SmolLM2 lean 0.129x dense, now bound by the
#   bisection, not launches), 98 (28/28 + 15/15), 99 (1M int4 + probes: 9.5 tok/s mean, p50 19.8),
#   100 (512K prefill steps: the CLI's chunks match the bench's), 101 (4/4/2: 1.36x lean, NIAH
#   61/66 + 66/66), 87 (probes' NIAH: the default's counts), and hip_offload at 48K profiled (the
#   bisection 1.17 s of lean's 2.12 s chunk), then decode profiles of the 1M slicing at 512K (host-
#   bound refresh steps). Then, on the CPU, the head score's logsumexp fused into the bisection.
#   Then a layer's slices rerun their stages in one batch (f0b7b1b). NEXT: call A (the GGUF's
#   first half) runs `bash bench/pending_h200.sh 102; bash bench/pending_h200.sh 104` (~3 min),
#   call B (the second half) 98 (the smoke, ~8 min), then 103 (the fused logsumexp, ~8 min), 99
#   (1M through the CLI again), 86 (probes beside the default at 512K: whether probes become
#   the default), 85, the 8B smoke, 83, 80, 73, 69.
# The thirty-ninth had no device time left (172 s). On the CPU: a layer's HiP decode steps as CUDA
#   graphs (04ca588 cached steps, bd7391d stage-1/2 reruns; KVTIER_HIP_GRAPHS=1, off until measured). NEXT: as the thirty-
#   eighth's NEXT, with 104 now also running --graphs and the CUDA checks (their hip-graphs rows),
#   98 (the smoke) a row with the graphs on through the CLI whose tokens must equal the row's without,
#   then 83 (issue 23's int4 at 512K with two heads a slice: simulated 0.217 s, asks 0.25) before
#   103; after 99, 105 (1M through the CLI with the graphs).
# The fortieth got an H100 at once (7972508): 102 (launch costs), 104 (graphs at 512K: cached
#   steps 2.38 -> 1.22 ms of 4 layers, bitwise in gpu_checks), 98 (30/31: the graphs row made no
#   graph, the model answered EOS at once; --ignore-eos since e389ac0), 83 (int4 512K auto 0.2646
#   s/token), 103 (fused logsumexp: no gain at 16K/48K), then at 3f2c265 the smoke's generate part
#   (31/31), 106 and 107 (graphs through the CLI: 512K 24.36 -> 31.06 tok/s), 105's command (1M:
#   19.03 tok/s). Graphs are the default on CUDA since d81e837. NEXT: call A (the GGUF's first
#   half) runs 109 (~5 min: where a stage-0 step goes; the graphs' declines), call B (the second
#   half) 108 (the smoke: graphs now the default), then 112 (103's kernel A/B, which timed the
#   max head score throughout), 110 (the CLI at 512K with graphs, probes
#   beside the default), 111 (1M over 161 tokens: steady state, per-step times, declines), 85,
#   the 8B smoke, 80, 73, 69.
# The forty-first lost ~800 s of its 1,800 to refused starts; on one H100 start at 0d24fa2 it ran
#   113 (the stage-0 parameter copy's A/B: counted H2D 603 -> 335 MB, time within noise), 108
#   (the smoke, 31/31 + 15/15), 109 (the stage-0 step: host work and 4 syncs a slice) and 111
#   (1M over 161 tokens: 17.86 tok/s). Then it cut the refetch's host work (GPU-facing, never run
#   on a GPU). NEXT: 114 (the tests' CUDA cases of this session's changes, then gpu_checks) with
#   the GGUF's first half, 115 (1M again, second half), 116 (--hip-align-window on: 1M beside
#   115, and its NIAH), then 112, 110, 85, the 8B smoke, 80, 73.
# The forty-second got an H100 at once (ffd1cd6): 114 (63 CUDA test cases, gpu_checks all equal),
#   115 (1M: 16.14 tok/s; stage-0 reruns 0.59-1.77 s), 116 (align on: reruns steadier, every
#   other step slower, 14.78 tok/s; NIAH 58/66 against 59/66), 108 (31/31 + 15/15), 117 (align's
#   A/B at 512K: cached steps 1.3 -> 2.0 ms for 4 layers), 112 (its SmolLM2 row faulted: the bench's
#   prefixes kept sinks past the first blocks' queries; fixed), then a refused start, then at
#   7976271 112's SmolLM2 row and the CUDA cases of test_step_probe/test_triton_attn.
#   NEXT: 118, 119, 120 (1M with --hip-refresh 64/8/4, the default, 128/8/4; each step's bytes,
#   GC pauses and mallocs; GGUF: 118 as call B), 121 (decode fidelity at 70K on CUDA), 110, 85,
#   the 8B smoke, 80, 73.
# The forty-third (H200 refused; an H100 at 1dc2323) ran 118 (21.92 tok/s), 121 (70K copy: dense
#   0.008, 32/8/4 0.574, 128/8/4 0.578), 120 (31.59), 119 (19.52), the prose NIAH at 128/8/4 and
#   64/8/4 (59/66 each), 120 again (30.93) and 512K at 128/8/4 (36.24); `lean` is now 128/8/4.
#   NEXT: 108 (the embedded smoke: the new interval, the empty-program skip), 122 (RULER, pooled
#   stage-2 queries), 110, 85, the 8B smoke, 80, 73.
# The forty-fourth (four refused starts; an H100 at 96d3962, then an H200 at 1090b48) ran 122's
#   kernels (prune 7.76 -> 5.70 ms) with the GGUF's first half, 108 (31/31 + 15/15), 123 (int4
#   512K split timers: 0.2620 s/token, 20 and 44 CPU slices slower), 122's RULER (strides 4/4/2:
#   33.2 vs 34.7) and prefill (lean 0.169x dense, strides 0.221x); on the H200 124 (--trace-cpu:
#   a CPU-bound step is the CPU's jobs plus ~2.4 ms of handoff a layer) and auto with and without
#   --unpack-planned (0.2950, 0.3762). NEXT: 126 (the CUDA checks and timelines after the
#   handoff cut), 125 (int4's slicings), 110, 85, the 8B smoke, 80, 73.
# The forty-fifth (nine refused or skipped calls; one H100 start at fdad1e2) ran 127 (the CUDA
#   checks with the stream's wait for CPU results: every cpu row equal; int4 512K auto with it
#   0.2586 s/token) and 128 (its three runs with the stream's wait hung; lossless host 0.6553).
#   The stream's wait became opt-in; its two suspects were removed at 2c63cf0+. NEXT: 129 first
#   (the CUDA checks with it, the A/B on one plan, under --watchdog), 130 (lossless), then the embedded smoke
#   (the default path's CPU-slice buffers are now reused per layer), 125, 110, 85, 80, 73.
# The forty-sixth (one H100 start at 000f6c1; then refusals) ran 129 (no hangs; host 0.2811,
#   stream 0.2685, stream + mapped results 0.2780 on one plan, inside a run's spread), 130, the
#   embedded smoke (31/31, 15/15), 125 and a CPU-count sweep. Since: the int4 CPU kernel ~1.1x per
#   thread (51d0e43), and a packed slice's loads copy runs of adjacent 16 MiB extents up to
#   64 MiB at once (a quarter of the host's copies; GPU-facing, unrun: 131 starts with the CUDA
#   checks). NEXT: 131 (~8 min: the checks; the int4 kernel beside H2D copies; copy vs mapped over
#   12 steps, twice; 14 CPU threads), the embedded smoke, then 110, 85, the 8B smoke, 80, 73.
# The forty-seventh (six refused or skipped calls; one H100 start at b215fec) ran 131 (ROUNDS=1:
#   checks pass; the int4 kernel keeps 27.5 GB/s beside the link; mapped 0.2446 vs copy 0.2618;
#   14 threads slower), 132 (embedded smoke 31/31, 15/15; a cProfile'd int4 step: 271 H2D copies
#   where 129 had 692), two more copy/mapped rounds (mapped 0.2389, 0.2401; copy 0.2592, 0.2572),
#   auto's CPU count with both (0.2427) and lossless 512K with both (0.6497). The stream's wait
#   and mapped results became the library's defaults on CUDA (this script's tiered_store rows
#   keep --cpu-handoff host --cpu-results copy unless they say otherwise). NEXT: 133 (the GGUF's
#   two-call setup first: the smoke's new --cpu-attention row with the new defaults, the CUDA
#   checks with them), 134 (on an H200 if one comes: the new defaults against the old), then
#   110, 85, the 8B smoke, 80, 73.
# The forty-eighth (every start refused: ~1,500 s of device time went on refusals) built issue
#   19's exact fine-chunk scoring (--hip-exact 8) and 64-key attention tiles for 64-dim heads.
#   NEXT: 135 (no GGUF: the kernels; carry the GGUF's first half with it), 136 (its prefill and
#   NIAH), 137 (the smoke's generate part and the CUDA checks with issue 23's defaults, RULER with
#   --hip-exact 8), 134, then 110, 85, the 8B smoke, 80, 73.
# The forty-ninth (every start refused again) built the prefill by layer (--prefill-order layer:
#   no chunk re-streams the stored prompt) for issue 19's 512K prefill. NEXT: 141 (call A, with
#   the GGUF's first half: gpu_checks' by-layer rows, the exact kernel), 142 (call B: 512K
#   through the CLI, lean / + exact 8 / + by layer), 143 (fast and lossless by layer), 136, 137:
#   if by layer wins and its checks are bitwise, make it the default where the store can. With
#   too little device time for the GGUF's two calls, 144 alone (the checks and a 128K A/B).
# The fiftieth ran 145 (the checks: by layer bitwise), 146 (512K by layer: out of memory with the
#   last token inside the pass, fixed; then lean+exact 8 5,094 and fast+exact 32 8,641 tok/s), a
#   fast chunk/layer A/B (13,176 vs 11,148: HiP's 512K prefill is compute-bound) and 136's
#   prefill and NIAH lines (exact 8: 0.235x dense at lean's NIAH counts). NEXT: 145 then 148
#   (the exact prefill's profile, RULER and pass key with it, decode after a layer-order
#   prefill), 147 (lossless at 512K on the same card), 149 and 150 (no GGUF: stage 0's query
#   strides and groups, each stage's share at 512K), 137's smoke and checks, 134, then 110, 85, the 8B smoke, 80, 73.
# The fifty-first exposed stage-0 groups to requests (--hip-stage0). NEXT: 151 (call A, with the
#   GGUF's first half), 152 (call B: SmolLM2 16K with stage-0 groups, exact 8's RULER and pass
#   key), 153 (512K fast with stage-0 groups), 147 (lossless 512K on the same card), 149's
#   kernel row, 137's smoke, 148's decode after a layer-order prefill, then as the fiftieth's.
#   It ran 151, 152, 153, 147, 149's kernel row, 153 reversed, the embedded smoke's generate part
#   (32/32) at 92af773: exact 8's RULER 35.5 (lean 34.7), stage-0 groups 1.07x for fast at 512K
#   (3.73x lossless on one start), none at 16K. NEXT: 151 (call A), 154 (call B: RULER with
#   stage-0 groups, the exact prefill's profile, decode after a layer-order prefill), 155 (lean at
#   512K with and without exact 8), 158 (stage 0 on landmark keys, --hip-landmarks: 512K
#   and NIAH; the likeliest lever for 512K's 5x), 157 (fast with its 8-token stage exact), 156 (an
#   early chunk's time above the matmuls, profiled; the exact kernel's sweep),
#   the embedded smoke's generate part (the row tiles changed
#   after its 92af773 run), 137's checks and RULER rows, 134, 110, 85, the 8B smoke.
# The fifty-seventh ran 171 and 172 at 60b31e2 (two refused starts and a pause first): 4.89x with
#   all three changes, the first decode step after a prefill by layer fixed (0.10-0.17 s). NEXT:
#   175 then 177 at once (no GGUF, ~8 + 7 min: the 5x row with stage 0 once per 4 query blocks,
#   the combined row again, the plain row 171 lost; auto, pinning from threads), then 173 and 176
#   (the GGUF: their 64K needles), the embedded smoke.
# The fifty-eighth ran 178, 179, 180 and two calls after them at 95a8615 (three refused starts
#   first): 5.05x at 512K with the warm-up, probes, strides 4/4/2 and stage-0 groups, but the
#   strides cost 4 of 33 needles at 64K (probes alone keep 15); 4.32x without them; the first
#   prefill step 2.07 -> 0.17 s with KVTIER_WARMUP=thread (now the default); the embedded generate
#   smoke 38/38 with the warm-up off. NEXT: 181 (carry .tok, .whl, .gguf_a: the probes row
#   without strides again after a warm-up that compiles its kernels, auto with the warm-up as
#   its base), then 182 at once (carry .gguf_b, .whl: that row's 64K needles, the embedded
#   smoke's plan, eval and serve sections with the warm-up on), then 183 (its generate section).
# The fifty-ninth ran 181, 182, 183 (its generate smoke; the huge-page row as a call of its own)
#   and the no-strides row again with cudaHostAlloc at 37c7fc2 (four refused starts first; the
#   start took ~9 min): 4.67x at 512K with fast's 15 of 33 needles; KVTIER_HOST_PIN=huge's setup
#   3.4 s against 27.2 but decode 18.4 against 30.5 tok/s; the smoke 38/38 and 15/15 with the
#   warm-up on. 181's own 512K HiP row wrote no JSON (its 115 s limit, the model's first load
#   on the start 15.8 s). NEXT: 184 (carry .tok only), then at once 185 (carry
#   .gguf_a) and 186 (carry .gguf_b, .whl).
# The fifty-third got one device call after seven refused starts (163: fast 13,181 tok/s at 512K
#   through the CLI; landmarks slower, their key scores in a float64 cumsum, now blocked) and the
#   last ~150 s for two kernel rows. NEXT: 164 (no GGUF: the 512K CLI A/B after the blocked sums,
#   with landmarks plus pooled pairs in stage 2), 165 (GGUF: their NIAH at 64K; 64K held bytes),
#   160's profiled offload rows, then the fifty-second's list (154, 155, 156, the smoke, ...).
# The fifty-fourth ran 164 and 165 (all of 165's JSONs but the NIAH's first two methods lost to a
#   copy of every smoke JSON into $OUT), an auto baseline and the landmark kernels (Triton) at
#   cc10f06: stage 0 on landmarks 1.75 ms a layer at 512K (bisection 10.2), key scores 0.88 ms
#   (2.93). NEXT: 166 and 167 at once (no GGUF: the 512K CLI A/B with the kernels, by chunk and by
#   layer, beside auto; stage 2 exact; SmolLM2's kernels with exact 8 and pooled pairs), then
#   the embedded smoke (`gpu_smoke.py --models embedded --out $OUT/...`: its default --out is
#   bench/results, which a copy into $OUT must not sweep up), then the fifty-third's list (160,
#   154, 155, 156, ...).
#   Before it, the fourteenth's plan: 41 (no GGUF), 40 with HAYSTACKS=repeat, 36's 16K cells and 4K/8K rows, 37, 33, 34,
#   29's sampled case (the GGUF's two-call setup first; 33 needs the smoke's llama8b folder).
#   Before it, the plan was: 38 with the GGUF's first half, the whole smoke (22), then 36 and 37 (issue 19's
#   quality grid, RULER and pass key; the GGUF is in place after 22), 33, 34; 29's sampled case.
#   Before it, the twelfth's plan was: first the whole smoke (GPU-facing code changed after it ran: the batched sampler,
#   begin_decode, incremental text, --decode-steps, the frozen heap): carry .whl and .gguf_a, copy
#   the half to /tmp/gg, then at once carry .whl and .gguf_b: bash bench/pending_h200.sh 22; then
#         bash bench/pending_h200.sh 29  # (~9 min; carry .whl and .tok) host work per step: the
#                                        #   batch stream's idle time, text decoding, batched sampling;
#         bash bench/pending_h200.sh 30  #   then (~8.5 min) --decode-steps 2, the heap unfrozen, and the
#                                        #   24 GiB mixed case with it frozen
# Before (both ran at 8da3735 but for the embedded model's smoke checks, cut off by short limits):
#   group 1 (the smoke in full, after this session's expert offload), then
#   bash bench/pending_h200.sh 14  # (~6 min) issue 23 at 512K with 1 and 2 KV heads a slice
# The 2026-12-01 evening run: one gpu_smoke of both models did not fit 420 s (a check a time,
# ~17 s each), hence the parts and --jobs.
set -u
group=${1:-1}
py=${PYTHON:-python}
run() { echo "== $*"; timeout "$@" 2>&1 | grep -v '^{' | tail -"${RUN_TAIL:-14}"; }
# issue 23: lossless bf16 auto at 512K, the host waiting for CPU slices' results, then the
# stream (StoreOptions.cpu_handoff), each run under $1 seconds (its watchdog 20 s before)
lossless_handoff_pair() {
  for h in host gpu; do
    run "$1" $py bench/tiered_store.py --contexts 512K --policies auto --cpu-attention auto \
      --full-prefill-max 1 --gpu-memory 24GiB --decode-steps 4 --cpu-handoff $h \
      --watchdog $(($1 - 20)) --name "cpu_attention_512k_handoff_$h"
  done
}
# issue 19's A/B of a layer's cached slices at once against a slice at a time (88, 90): $1
# layers of 2-head slices at 128K, lean, host keys, each run under $2 seconds
layer_ab() {
  for a in "" "--slice-at-a-time"; do
    run "$2" $py bench/hip_decode_profile.py --as-preset --preset lean --context 128K --layers "$1" \
      --kv-heads 8 --group 2 --head-dim 128 --steps 34 --kv-fill structured --host-scoring $a \
      --name "hip_decode_profile_lean_128k_g2_layer_ab${a:+_slices}"
  done
}
# one 512K `kvtier generate` row set through hip_cli_speed (8 new tokens, no warm-up): $1 the run's
# seconds, $2 the methods, $3 the JSON's name, the rest more flags
# (the CLI's own limit 20 s inside the run's: a killed 512K process takes seconds to give its
# ~68 GB of pinned memory back, and 181's 512K row, 5 s inside, lost its JSON row so)
cli512k() {
  local secs=$1 methods=$2 name=$3
  shift 3
  run "$secs" $py bench/hip_cli_speed.py --contexts 512K --warmup-tokens 0 --methods "$methods" \
    --new-tokens 8 --timeout $((secs - 20)) --name "$name" "$@"
}
# SmolLM2's prose NIAH at 64K on CUDA, 11 depths x 3 samples (the 64K rows' prompts): $1 the run's
# seconds, $2 the method spec, $3 the JSON's name under $OUT
niah64k() {
  run "$1" kvtier eval niah --lengths 64k --depths 0:100:10 --samples 3 --first-sample 0 --seed 0 \
    --haystack prose --device cuda --max-model-len 66000 --no-progress --method "$2" --out "$OUT/$3.json"
}
# the embedded model's CUDA NIAH grid at 16K and 32K, 11 depths x 3 samples: $1 haystack, $2 the
# method spec, $3 the JSON's name under $OUT
niah_cuda() {
  run 160 kvtier eval niah --lengths 16k,32k --depths 0:100:10 --samples 3 --haystack "$1" --device cuda \
    --max-model-len 33000 --method "$2" --no-progress --out "$OUT/$3.json"
}
# lean's prefill kernels alone: SmolLM2's 16K chunk (named $1), then Llama-3's 16K chunk at 48K
# (8 KV heads a slice) with the softmax and the max head score (hip_kernels_lean_48k_<score>$2):
# what the per-row maxima cost the bisection at the same chunking
lean_kernels() {
  run 150 $py bench/hip_kernels.py --model smollm2-135m --preset lean --context 0 --chunk 16384 --heads 3 \
    --name "$1"
  for hs in softmax max; do
    run 120 $py bench/hip_kernels.py --preset lean --context 48K --chunk 16384 --heads 8 --head-score $hs \
      --name "hip_kernels_lean_48k_$hs$2"
  done
}
case "$group" in
186)
  # (~9 min; right after 185; .gguf_b and .whl carried: `source bench/h200_setup.sh` joins the
  # halves) whether HiP's default could carry the speed options that cost `fast` no needle
  # (landmarks, probes, stage-0 groups; the layer order is lossless): lean with them, the
  # preset `--attention hip` runs past a model's trained length. Its NIAH at 16K and 32K (lean
  # 30 and 29 of 33 on prose) and 64K (lean 19, with landmarks 20), then its 512K CLI row (lean
  # alone 5,195 tok/s, 1.41x, at 5f5d2dd) against 184's auto
  opts="hip_landmarks=on,hip_probes=on,hip_stage0=256"
  niah_cuda prose "hip,$opts" niah_smollm2_cuda_prose_lean_speed_options_x3
  niah64k 150 "hip,$opts" niah_smollm2_cuda_prose_64k_lean_speed_options_x3
  cli512k 200 "hip,$opts,prefill_order=layer" hip_cli_speed_512k_lean_speed_options
  ;;
185)
  # (~4 min; after 184 on the same start, its 8B folder in place; .gguf_a carried: call A of the
  # GGUF's two, 186 at once after it) KVTIER_LOAD=staged against safe_open: the 8B model's 16 GB
  # took 11.0-15.8 s to load in 37c7fc2's 512K rows
  mkdir -p /tmp/gg && cp .gguf_a/gguf_part_aa /tmp/gg/
  run 150 $py bench/load_speed.py --rounds 2 --name load_speed_8b
  # (~2 min more) the pruning kernel's chunks a program and warps beyond the sweep's 16-64 and 2,
  # stage by stage at 512K (stage 2, 7.6 ms of a 16K chunk's ~27.7 ms at 512K, is the largest part)
  run 150 $py bench/hip_kernels.py --context 512K --chunk 16384 --heads 8 --preset fast --bisect-sweep \
    --name hip_kernels_512k_bisect_sweep
  ;;
184)
  # (~8 min; .tok/ carried, no GGUF) issue 19's 5x at 512K without a quality cost (4.67x at
  # 37c7fc2, layer 0 1.29 s against 1.06 for layers 1-3 while it pins the hidden pieces): a 64K
  # run of the row's kernels, the row with KVTIER_HIDDEN_PIN=huge (its pieces registered in huge
  # pages, 17 GB/s against 8.5), lossless auto as its base; then host_memory.py over one 16 GiB
  # piece (KVTIER_HOST_PIN=huge's decode read the 68 GB host tier slower, one 1 GiB piece not)
  lm="hip,hip_preset=fast,hip_landmarks=on,prefill_order=layer,hip_probes=on,hip_stage0=256"
  KVTIER_HIDDEN_PIN=huge run 80 $py bench/hip_cli_speed.py --contexts 64K --warmup-tokens 0 \
    --methods "$lm" --new-tokens 2 --timeout 65 --name hip_cli_speed_64k_warmup_184
  KVTIER_HIDDEN_PIN=huge cli512k 160 "$lm" hip_cli_speed_512k_fast_landmarks_layer_probes_stage0_hidden_huge
  cli512k 250 auto hip_cli_speed_512k_auto_base_i
  run 90 $py bench/host_memory.py --total 16GiB --piece 16GiB --name host_memory_16g
  ;;
1)
  # the smoke's generate part, a model at a time: both in one 330 s run were cut after 49 of 54
  # checks on a fresh machine (the 8B folder and the GGUF's conversion come first). Then 64.
  run 300 $py bench/gpu_smoke.py --models llama8b --sections generate --jobs 4 --out "$OUT/gpu_smoke_generate.json"
  run 220 $py bench/gpu_smoke.py --models embedded --sections generate --jobs 4 --out "$OUT/gpu_smoke_generate_embedded.json"
  ;;
64)
  # the smoke's plan, eval and serve part (needs .whl) and the CUDA checks
  run 250 $py bench/gpu_smoke.py --sections plan,eval,serve --out "$OUT/gpu_smoke_serve.json"
  run 60 $py bench/gpu_checks.py
  ;;
63)
  # issue 19 at 1M over int4 after ef5a9e9 (the warm-up decodes the timed step count, so the host
  # gather's kernel compiles before the clock; at e85b67e the first timed steps took 4.69 and
  # 0.62 s against 2.27 and 0.105) and the decode scoring slab counted in key vectors (a 2-head
  # slice's stage 0 scores 1M candidates in 4 products, not 16: 302 operators for the three
  # stages on the CPU where 1,091 ran; stage-0 steps took 2.45-2.50 s): fast's amortized time
  # (0.221 at 9fcd0cb, 0.287 at e85b67e with the compile), with the step profiles again. No GGUF.
  run 330 $py bench/hip_offload.py --contexts 1M --presets fast --policy planned --steps 34 \
    --no-dense --kv-quant int4 --profile-decode --name hip_offload_planned_1m_int4_slab
  ;;
65)
  # 512K through the CLI after the slab change (8-head slices: their slab is unchanged; the
  # HiP reserve grew ~143 MB, so the plan may differ): 9.85 tok/s at e85b67e. Needs the GGUF
  # (the 8B folder takes its tokenizer).
  run 290 $py bench/hip_cli_speed.py --contexts 512K --methods "hip,hip_host_keys=off" --new-tokens 64 \
    --timeout 280 --warmup-tokens 0 --name hip_cli_speed_512k_hip_slab
  ;;
66)
  # issue 19: stage-0 decode reruns scored on keys read from pinned host memory (8bf13d8,
  # HipConfig.host_scoring) against streaming the slice whole, lean at 512K, 8 layers of
  # Llama-3's shapes in 8-head slices with the CLI's 16K-token block cache (stage-0 steps took
  # 0.81 s, stage-1 99 ms at 08be223, hip_decode_profile_lean_512k_gather_steps.json). No GGUF.
  for hs in "" "--host-scoring"; do
    run 200 $py bench/hip_decode_profile.py --as-preset --preset lean --context 512K --layers 8 \
      --kv-heads 8 --group 8 --head-dim 128 --cache-tokens 16384 --steps 34 --kv-fill structured \
      $hs --name "hip_decode_profile_lean_512k${hs:+_host_scoring}"
  done
  ;;
67)
  # 66 through the CLI: `--hip-host-keys on` at 512K (65 is the same run without it, on the same
  # machine start). Its plan differs too since cbd7b07: the staging buffers are given back in
  # decode and the layer slices get caches of a whole refresh interval (16K tokens without),
  # so stage-1/2 reruns should not miss. Watch the peak (24 GiB cap). Needs the GGUF.
  run 240 $py bench/hip_cli_speed.py --contexts 512K --methods "hip,hip_host_keys=on" --new-tokens 64 \
    --timeout 230 --warmup-tokens 0 --name hip_cli_speed_512k_hip_host_keys
  ;;
68)
  # 128K through the CLI, host keys against streaming (the plan's cache covers a refresh
  # interval there; 27.4 tok/s decode at e85b67e, hip_cli_speed_128k_ab.json). Needs the GGUF.
  run 280 $py bench/hip_cli_speed.py --contexts 128K --methods "hip;hip,hip_host_keys=on" --new-tokens 64 \
    --timeout 120 --name hip_cli_speed_128k_host_keys
  ;;
69)
  # 63 with host keys: stage 0 on keys read from the host (int4 rows are read whole), the staging
  # buffers given back in decode and the block caches planned on their bytes (cbd7b07). No GGUF.
  run 330 $py bench/hip_offload.py --contexts 1M --presets fast --policy planned --steps 34 \
    --no-dense --kv-quant int4 --host-scoring --name hip_offload_planned_1m_int4_host_keys
  ;;
71)
  # issue 23: bf16 tokens and 4-bit rows attended 16 floats a vector on the host's AVX-512
  # (1.09x and 1.24x the 8-float paths' token rates at one thread on the dev machine,
  # cpu_attention_rows_cpu_wide.json); int4 at 512K with CPU slices (12 forced, and what `auto`
  # picks on the preset's old rate): 0.349 s/token on the link alone, 0.392 with 12 CPU slices
  # before; lossless 512K with CPU slices (0.678 s at 8da3735, 0.65 asked). If the rates hold,
  # refit the H200 preset's CPU rates (kvtier.planner.hardware) from the JSONs. No GGUF.
  run 90 $py bench/cpu_attention_rows.py --threads 1,8,15 --bits 4,8 --name cpu_attention_rows_h200_wide
  run 250 $py bench/tiered_store.py --contexts 512K --policies auto+int4 --cpu-attention off,auto,12 \
    --full-prefill-max 1 --gpu-memory 24GiB --decode-steps 4 --name cpu_attention_int4_512k_wide
  run 240 $py bench/tiered_store.py --contexts 512K --policies auto --cpu-attention auto \
    --full-prefill-max 1 --gpu-memory 24GiB --decode-steps 4 --name cpu_attention_decode_wide
  ;;
74)
  # issue 23: the layer's CPU slices merged in one batch with one asynchronous copy (the
  # twenty-ninth session; each slice's pageable copy had made the host wait for the device every
  # layer). One KV head a slice took 0.706 s/token at 512K (cpu_attention_512k_g1.json, 0.634
  # simulated), four 0.678 (cpu_attention_decode_3buf.json; 71's last row runs four after the
  # change, with the 16-float kernel). No GGUF.
  run 250 $py bench/tiered_store.py --contexts 512K --policies auto --cpu-attention auto --head-group 1 \
    --full-prefill-max 1 --gpu-memory 24GiB --decode-steps 4 --name cpu_attention_512k_g1_merged
  ;;
75)
  # issue 19 ("every HiP and Quest speed over structured KV") and Quest's GPU page reads (the
  # twenty-ninth session: the GPU reads the selected pages from pinned memory, no host sync; at
  # 512K over synthetic KV the CPU gather took 3.22 s a step, quest_offload.json). --kv-fill auto
  # fills Quest rows with structured KV. No GGUF.
  run 280 $py bench/tiered_store.py --contexts 512K --full-prefill-max 1 --policies head+quest4096p16 \
    --decode-steps 4 --name quest_offload_structured
  ;;
72)
  # issue 18: the mixed case (one 256K request beside 32 short streams, 24 GiB) with the long
  # request naming HiP: its store, block caches, decode rows and RoPE table in lent pool pages
  # (9daadb9; CPU-checked only). The lossless case: 1.50x the shorts' TPOT, 1.16x the floor.
  run 330 $py bench/serve_gpu.py --gpu-memory 24GiB --cases mixed --long-method hip \
    --mixed-timeout 300 --name serve_gpu_24gib_mixed_hip
  ;;
73)
  # 72 with Quest (its page bounds in lent pages since 5860240): a 2K budget over 16-token pages.
  run 330 $py bench/serve_gpu.py --gpu-memory 24GiB --cases mixed --long-method "quest,kv_budget=2k" \
    --mixed-timeout 300 --name serve_gpu_24gib_mixed_quest
  ;;
76)
  # issue 23: `--cpu-attention auto` now picks the slicing by its split's simulation (the thirtieth
  # session): one KV head a slice at 512K (0.671 s/token measured with --head-group 1 against
  # 0.709 for four, one start), two at 128K (0.116 simulated against 0.124; four measured 0.121
  # at 8da3735). No GGUF.
  run 250 $py bench/tiered_store.py --contexts 512K --policies auto --cpu-attention auto \
    --full-prefill-max 1 --gpu-memory 24GiB --decode-steps 4 --name cpu_attention_512k_auto_split
  run 150 $py bench/tiered_store.py --contexts 128K --policies auto --cpu-attention auto \
    --full-prefill-max 1 --gpu-memory 24GiB --decode-steps 4 --name cpu_attention_128k_auto_split
  # int4 with one KV head a slice (auto then left a quantized cache's slicing alone): simulated
  # 0.245 s/token against 0.294 for four heads on the link alone, which measured 0.348 (the GPU's
  # unpacking is not modelled); four with CPU slices measured 0.315 (issue 23 asks 0.25).
  run 200 $py bench/tiered_store.py --contexts 512K --policies auto+int4 --cpu-attention auto --head-group 1 \
    --full-prefill-max 1 --gpu-memory 24GiB --decode-steps 4 --name cpu_attention_int4_512k_g1
  # lossless 512K, one head a slice: more CPU slices than the split's 104 (the link carried
  # 33.8 GB a token, 0.61 s, at 0.671 s/token; 0.65 asked)
  run 280 $py bench/tiered_store.py --contexts 512K --policies auto --cpu-attention 104,120,136 --head-group 1 \
    --full-prefill-max 1 --gpu-memory 24GiB --decode-steps 4 --name cpu_attention_512k_g1_sweep
  ;;
79)
  # 76 split to fit one call (its four rows take ~880 s): the rows that may close issue 23 first,
  # 512K lossless under the auto split and int4 with one KV head a slice. No GGUF.
  run 250 $py bench/tiered_store.py --contexts 512K --policies auto --cpu-attention auto \
    --full-prefill-max 1 --gpu-memory 24GiB --decode-steps 4 --name cpu_attention_512k_auto_split
  run 200 $py bench/tiered_store.py --contexts 512K --policies auto+int4 --cpu-attention auto --head-group 1 \
    --full-prefill-max 1 --gpu-memory 24GiB --decode-steps 4 --name cpu_attention_int4_512k_g1
  ;;
80)
  # 76's other rows: 128K under the auto split, the one-head 512K CPU-slice sweep. No GGUF.
  run 150 $py bench/tiered_store.py --contexts 128K --policies auto --cpu-attention auto \
    --full-prefill-max 1 --gpu-memory 24GiB --decode-steps 4 --name cpu_attention_128k_auto_split
  run 280 $py bench/tiered_store.py --contexts 512K --policies auto --cpu-attention 104,120,136 --head-group 1 \
    --full-prefill-max 1 --gpu-memory 24GiB --decode-steps 4 --name cpu_attention_512k_g1_sweep
  ;;
81)
  # issue 23 after 7af4a1c (packed loads unpack on their own stream, two scratches): int4 at 512K
  # with one KV head a slice, link alone and with CPU slices (0.275 s/token at e00201f, where the
  # link's 11.6 GB take 0.21 s), and four heads (0.315 at 182bb02); then the CUDA checks (int4
  # rows: tokens equal the packed cache streamed whole). No GGUF.
  run 170 $py bench/tiered_store.py --contexts 512K --policies auto+int4 --cpu-attention off,auto --head-group 1 \
    --full-prefill-max 1 --gpu-memory 24GiB --decode-steps 4 --name cpu_attention_int4_512k_g1_unpack_stream
  run 100 $py bench/tiered_store.py --contexts 512K --policies auto+int4 --cpu-attention auto \
    --full-prefill-max 1 --gpu-memory 24GiB --decode-steps 4 --name cpu_attention_int4_512k_unpack_stream
  run 80 $py bench/gpu_checks.py
  ;;
82)
  # issue 23: where int4's ~55 ms over the link goes (0.348 s/token at 512K, one KV head a slice,
  # link alone, for 16.2 GB = 0.293 s): one decode step traced (is the link idle, or slow?), a
  # third staging buffer, and lossless link-alone traced beside it. No GGUF.
  run 100 $py bench/tiered_store.py --contexts 512K --policies auto+int4 --cpu-attention off --head-group 1 \
    --full-prefill-max 1 --gpu-memory 24GiB --decode-steps 3 --trace-step --name int4_512k_g1_trace
  run 90 $py bench/tiered_store.py --contexts 512K --policies auto+int4 --cpu-attention off --head-group 1 \
    --full-prefill-max 1 --gpu-memory 24GiB --decode-steps 3 --staging-buffers 3 --name int4_512k_g1_3buf
  run 90 $py bench/tiered_store.py --contexts 512K --policies auto --cpu-attention off --head-group 1 \
    --full-prefill-max 1 --gpu-memory 24GiB --decode-steps 3 --trace-step --name lossless_512k_g1_trace
  ;;
83)
  # issue 23: --cpu-attention auto now tries finer slicings over int4 too (the simulation takes
  # two KV heads a slice at 512K with the H200's measured packed rates: 0.217 s against 0.221 for
  # one, measured 0.275, and 0.273 for four, measured 0.315). No GGUF.
  run 120 $py bench/tiered_store.py --contexts 512K --policies auto+int4 --cpu-attention auto \
    --full-prefill-max 1 --gpu-memory 24GiB --decode-steps 4 --name cpu_attention_int4_512k_auto_slicing
  run 120 $py bench/tiered_store.py --contexts 512K --policies auto+int4 --cpu-attention auto --head-group 1 \
    --full-prefill-max 1 --gpu-memory 24GiB --decode-steps 4 --name cpu_attention_int4_512k_g1_same_start
  ;;
84)
  # issue 23, int4's link idle (55 ms a token at 512K, one head a slice: int4_512k_g1_trace.json,
  # an H100). The traced step's H2D stream ran 256 unpacks (37 ms) and 448 device-to-device row
  # copies between its host copies: 192 streamed unpacks (~28 ms) and 64 device-packed loads
  # (~18 ms) account for ~46 of the 55. StoreOptions.unpack_stream (--unpack-stream) takes both
  # off it: the A/B on one machine start, traced, then with CPU slices; then the CUDA checks
  # (int4-unpack-stream rows: bitwise). No GGUF.
  for a in "" "--unpack-stream"; do
    run 100 $py bench/tiered_store.py --contexts 512K --policies auto+int4 --cpu-attention off --head-group 1 \
      --full-prefill-max 1 --gpu-memory 24GiB --decode-steps 3 --trace-step $a --name "int4_512k_g1_trace_ab${a:+_unpack}"
  done
  for a in "" "--unpack-stream"; do
    run 100 $py bench/tiered_store.py --contexts 512K --policies auto+int4 --cpu-attention auto --head-group 1 \
      --full-prefill-max 1 --gpu-memory 24GiB --decode-steps 4 $a --name "int4_512k_g1_cpu_ab${a:+_unpack}"
  done
  run 80 $py bench/gpu_checks.py
  ;;
104)
  # (~5 min, no GGUF) the 1M plan's decode (lean, 4-head slices over int4, stage 0 on probes in
  # place) after a layer's slices rerun stages 1.. in one batch (f0b7b1b; CPU counts: stage-1
  # reruns 114 -> 85 operators a slice, stage-2 77 -> 62): the same command as this session's
  # hip_decode_profile_lean_512k_int4_probes_g4_steps.json (stage-2 rerun ~21 ms, stage-1 ~30 ms
  # a step of 4 layers), slice by slice on the same start (--slice-at-a-time), and (the thirty-
  # ninth session, 04ca588, bd7391d) each layer's steps replayed as CUDA graphs (--graphs: the
  # "none" steps, 4.4 ms a step of 4 layers before, and the stage-1/2 reruns). Then the CUDA
  # checks: hip-graphs rows bitwise against the same steps op by op, captures and replays counted.
  for a in "" "--slice-at-a-time" "--graphs"; do
    run 60 $py bench/hip_decode_profile.py --as-preset --preset lean --context 512K --layers 4 --kv-heads 8 \
      --group 4 --head-dim 128 --steps 66 --kv-fill structured --host-scoring --probe-scoring --kv-quant int4 \
      $a --name "hip_decode_profile_lean_512k_int4_probes_g4_layer${a:+_${a#--}}"
  done
  run 120 $py bench/gpu_checks.py
  ;;
108)
  # (~9 min, GGUF; the fortieth session's NEXT, call B after the GGUF's first half) the embedded
  # smoke: HiP decode graphs are the default on CUDA since d81e837 (its graphs row runs the
  # default, its reference KVTIER_HIP_GRAPHS=0), and the probes rows pass --ignore-eos
  run 220 $py bench/gpu_smoke.py --models embedded --sections generate --jobs 4 --out "$OUT/gpu_smoke_generate_embedded.json"
  run 250 $py bench/gpu_smoke.py --models embedded --sections plan,eval,serve --out "$OUT/gpu_smoke_serve_embedded.json"
  ;;
109)
  # (~5 min, no GGUF) issue 19's 1M decode is bound by its stage-0 steps (2 of 64 at ~0.8 s,
  # the median step 21 ms with graphs: hip_cli_speed_1m_int4_probes_graphs.json). Where a
  # stage-0 step goes at 512K (lean, 4-head slices over int4, probes): cProfile and the GPU's
  # kernels of the stage-0 step at 32 (--profile-steps stage0), 4 layers; then the graphs'
  # declines by why at 512K through the bench (its kernel's counters)
  run 150 $py bench/hip_decode_profile.py --as-preset --preset lean --context 512K --layers 4 --kv-heads 8 \
    --group 4 --head-dim 128 --steps 34 --kv-fill structured --host-scoring --probe-scoring --kv-quant int4 \
    --profile --kernels --profile-steps stage0 --name hip_decode_profile_lean_512k_int4_probes_g4_stage0
  run 150 $py bench/hip_decode_profile.py --as-preset --preset lean --context 512K --layers 4 --kv-heads 8 \
    --group 4 --head-dim 128 --steps 66 --kv-fill structured --host-scoring --probe-scoring --kv-quant int4 \
    --graphs --name hip_decode_profile_lean_512k_int4_probes_g4_graphs_declined
  ;;
113)
  # (~6 min, no GGUF) issue 19's stage-0 reruns over int4 in place: each probe read its row's
  # fp16 key minima and steps (512 B of a head's 576) over PCIe; now the rows' parameters are
  # copied to the GPU first, once a row (triton_keys.key_params). The A/B at 512K on one start
  # (34 steps: stage 0 at steps 0 and 32); group 109 (its profile) after, where it is owed
  for kp in per-probe first; do
    run 100 $py bench/hip_decode_profile.py --as-preset --preset lean --context 512K --layers 4 --kv-heads 8 \
      --group 4 --head-dim 128 --steps 34 --kv-fill structured --host-scoring --probe-scoring --kv-quant int4 \
      --key-params $kp --name "hip_decode_profile_lean_512k_int4_probes_g4_params_$kp"
  done
  ;;
114)
  # (~3 min, no GGUF; owed since the forty-first session, whose device time ran out) the
  # tests' CUDA cases of what changed there: stage 0 in place over KIVI rows with the rows'
  # parameters copied first or read per probe (bitwise against the rows unpacked), the HiP
  # refetch's runs (test_cache_blocks) and the int4 tier's placement rows built on the GPU
  # (test_store, test_probe_scoring's int4 decode); then the CUDA checks
  run 150 $py -m pytest -q -p no:cacheprovider tests/test_probe_scoring.py tests/test_cache_blocks.py \
    tests/test_store.py -k "cuda or not cpu"
  run 150 $py bench/gpu_checks.py
  ;;
115)
  # (~4.5 min, GGUF; call B right after 114) group 111 again after the refetch's host work was
  # cut (~3 ms a slice of Python index work when a 1M stage-0 rerun turns the selection over)
  run 330 $py bench/hip_cli_speed.py --contexts 1M --methods hip,kv_quant=int4,hip_probes=on \
    --new-tokens 161 --timeout 320 --warmup-tokens 0 --name hip_cli_speed_1m_int4_probes_graphs_161_fetch
  ;;
116)
  # (~9 min, GGUF) --hip-align-window on (HipConfig.align_window, off by default): decode's window
  # at a stage-0 chunk boundary, so no partial chunk (CPU at 8K: no graph declines, a stage-0
  # rerun 11 -> 8 syncs a slice). 1M over int4 through the CLI beside group 115's row (same
  # command without it), then its NIAH on the embedded model (prose 16K/32K; the default's
  # 30/33 and 29/33: niah_smollm2_cuda_prose_hip_auto_x3.json)
  run 330 $py bench/hip_cli_speed.py --contexts 1M --methods hip,kv_quant=int4,hip_probes=on,hip_align_window=on \
    --new-tokens 161 --timeout 320 --warmup-tokens 0 --name hip_cli_speed_1m_int4_probes_graphs_161_align
  niah_cuda prose hip,hip_align_window=on niah_smollm2_cuda_prose_hip_align_x3
  ;;
117)
  # (~5 min, no GGUF) group 116's 1M run with --hip-align-window on had cheaper stage-0 reruns
  # (0.61-0.85 s against 0.59-1.77 s) but a slower median step (38.9 against 23.4 ms), 276 graph
  # captures against 96 and 32 "cached: a buffer full or behind" declines. The same A/B at 512K
  # through the bench, with graphs, on one start, to see where the steady steps' time goes
  for a in "" "--align-window"; do
    run 140 $py bench/hip_decode_profile.py --as-preset --preset lean --context 512K --layers 4 --kv-heads 8 \
      --group 4 --head-dim 128 --steps 98 --kv-fill structured --host-scoring --probe-scoring --kv-quant int4 \
      --graphs $a --name "hip_decode_profile_lean_512k_int4_probes_g4_graphs${a:+_align}"
  done
  ;;
118)
  # (~5 min, GGUF; call B after the first half) issue 19's 1M over int4 with stage 0 rerun every
  # 64 decode steps, not lean's 32 (--hip-refresh 64/8/4; stages 1-2 as lean). On the CPU proxy
  # (hip_decode_fidelity_cpu_copy7k_budgets8_refresh.json) 64/8/4 copied no worse than 32/8/4
  # (0.574 and 0.519), where InfiniteHiP's flash 96/24/8 lost to lean at real budgets (0.769
  # against 0.859, hip_decode_fidelity_cpu_copy7k.json). Both rows now carry each step's H2D
  # bytes, the collector's pauses and the allocator's cudaMallocs (StepProbe): which of them the
  # slow stage-0 reruns (0.59-1.77 s on the same work, groups 111/115) line up with
  run 300 $py bench/hip_cli_speed.py --contexts 1M --methods hip,kv_quant=int4,hip_probes=on,hip_refresh=64/8/4 \
    --new-tokens 161 --timeout 290 --warmup-tokens 0 --name hip_cli_speed_1m_int4_probes_graphs_161_refresh64
  ;;
120)
  # (~5 min, GGUF) as 118 with stage 0 every 128 steps (hip_decode_fidelity_cpu_copy7k_budgets8_stage0
  # .json: 128/8/4 0.570 against lean's 0.519 on the CPU proxy): one stage-0 rerun in 160 steps
  run 300 $py bench/hip_cli_speed.py --contexts 1M --methods hip,kv_quant=int4,hip_probes=on,hip_refresh=128/8/4 \
    --new-tokens 161 --timeout 290 --warmup-tokens 0 --name hip_cli_speed_1m_int4_probes_graphs_161_refresh128
  ;;
121)
  # (~3 min, GGUF) issue 19: HiP's decode fidelity on the embedded model past its trained length,
  # with lean's real budgets selecting in every stage: a 256-token copy of generated entries from
  # ~36K tokens back at 70K (bench/hip_decode_fidelity.py), refresh intervals apart. On the CPU
  # only a scaled-budget proxy could make stage 0 select (hip_decode_fidelity_cpu_copy7k_*.json)
  run 170 $py bench/hip_decode_fidelity.py --device cuda --text copy-entries --context 70000 --copy-span 36000 \
    --tokens 256 --max-model-len 80K --name hip_decode_fidelity_cuda_copy70k \
    --methods "auto;hip;hip,hip_refresh=64/8/4;hip,hip_refresh=128/8/4;hip,hip_refresh=flash;hip,hip_refresh=always"
  ;;
122)
  # (~10 min, GGUF) issue 19's SmolLM2 16K prefill (0.129x dense; the target 0.5x): lean's last
  # stage on pooled queries is the one lever measured (--hip-strides 4/4/2: 1.36x, NIAH prose
  # 31/30 of 33 against 30/29, repeat 33/33), RULER never ran with it. RULER 16K as lean's row
  # (ruler_smollm2_cuda_16k_lean_x10.json: 34.7), then the prefill with strides 4/4/2 and 4/4/4
  # beside the default on one start: whether pooled stage-2 queries can become lean's own. Both
  # prefill rows and the kernels alone (against hip_kernels_smollm2_16k_lean_softmax.json: the
  # bisection 5.15 ms of a 7.76 ms prune) time 0d86080's skip of programs with no live chunk
  # (53% of that grid)
  run 120 $py bench/hip_kernels.py --model smollm2-135m --preset lean --context 0 --chunk 16384 --heads 3 \
    --name hip_kernels_smollm2_16k_lean_skip
  run 200 kvtier eval ruler --lengths 16k --samples 10 --seed 0 --device cuda --method hip,hip_strides=4/4/2 \
    --no-progress --out "$OUT/ruler_smollm2_cuda_16k_lean_strides_x10.json"
  run 220 $py bench/hip_small_prefill.py --model smollm2-135m --lengths 16K --repeats 2 --new-tokens 8 \
    --methods "auto;hip;hip,hip_strides=4/4/2;hip,hip_strides=4/4/4" --name hip_small_prefill_strides_444
  ;;
123)
  # (~5 min, no GGUF) issue 23: int4 at 512K, two KV heads a slice (auto's slicing: 0.2646
  # s/token where the simulation said 0.217, cpu_attention_int4_512k_auto_slicing.json). Which
  # side bounds the split step: the row's cpu_split (the CPU's busy seconds and rate, the host's
  # wait for CPU results) at auto's count (32), then fewer and more CPU slices on one start
  run 120 $py bench/tiered_store.py --contexts 512K --policies auto+int4 --cpu-attention auto \
    --full-prefill-max 1 --gpu-memory 24GiB --decode-steps 5 --name cpu_attention_int4_512k_g2_timers
  run 200 $py bench/tiered_store.py --contexts 512K --policies auto+int4 --cpu-attention 20,44 --head-group 2 \
    --full-prefill-max 1 --gpu-memory 24GiB --decode-steps 5 --name cpu_attention_int4_512k_g2_sweep
  ;;
124)
  # (~5 min, no GGUF) issue 23: where int4's split step at 512K goes (two KV heads a slice, 32 on
  # the CPU: 0.262 s/token, the CPU's jobs 0.188 s of it, the simulation 0.216;
  # cpu_attention_int4_512k_g2_timers.json). One step's CPU timeline (--trace-cpu: the query's
  # way to the CPU, the jobs, the host between layers) and the link's (--trace-step); then the
  # same with the unpacks off the link's stream, and with a third staging buffer (at 25 GiB,
  # beside two there: a deeper prefetch while the host waits for the CPU)
  ts() { run "$1" $py bench/tiered_store.py --contexts 512K --policies auto+int4 --cpu-attention 32 --head-group 2 \
    --full-prefill-max 1 --decode-steps 4 --trace-cpu "${@:2}"; }
  ts 100 --gpu-memory 24GiB --trace-step --name int4_512k_g2_cpu32_timeline
  ts 100 --gpu-memory 24GiB --unpack-stream --name int4_512k_g2_cpu32_timeline_unpack
  ts 100 --gpu-memory 25GiB --name int4_512k_g2_cpu32_timeline_25g
  ts 100 --gpu-memory 25GiB --staging-buffers 3 --name int4_512k_g2_cpu32_timeline_25g_b3
  ;;
126)
  # SUPERSEDED by 127-130 (the forty-fifth session ran its CUDA checks and int4 timelines there);
  # only its last line, bench/layer_graph.py, has not run: worth a call only if the host's wait
  # stays the default. (~9 min, no GGUF) issue 23 after the forty-fourth session's handoff cut (a
  # layer's CPU parts merged in one pass, the CPU slices' write-backs queued before the wait: ~26
  # fewer operators after the wait a layer at three parts; bdf633b: the write-backs' event after
  # the copies they read). The CUDA checks (their CPU and int4-cpu rows); 124's unpack-stream
  # timeline again (the host between layers was 1.5-1.9 ms a layer on an H200,
  # int4_512k_g2_cpu32_timeline_unpack.json), with one step under cProfile (--profile-step: where
  # the rest goes); auto's 512K int4 (0.2620 s/token on an H100 start,
  # cpu_attention_int4_512k_g2_timers.json: compare on one machine kind), unfused and fused
  run 100 $py bench/gpu_checks.py
  run 100 $py bench/tiered_store.py --contexts 512K --policies auto+int4 --cpu-attention 32 --head-group 2 \
    --full-prefill-max 1 --decode-steps 4 --trace-cpu --profile-step --gpu-memory 24GiB --unpack-stream \
    --name int4_512k_g2_cpu32_timeline_unpack_cut
  for f in "" "--fuse"; do  # --fuse: the fused projections LLM and the CLI run (4 GEMMs a layer, not 7)
    run 120 $py bench/tiered_store.py --contexts 512K --policies auto+int4 --cpu-attention auto \
      --full-prefill-max 1 --gpu-memory 24GiB --decode-steps 5 --trace-cpu $f \
      --name "cpu_attention_int4_512k_g2_timers_cut${f:+_fused}"
  done
  # what a CUDA graph over a layer's dense work would take off that path (eager against replayed)
  run 60 $py bench/layer_graph.py --model llama-3-8b --layers 8
  ;;
127)
  # (~6 min, no GGUF; first) issue 23: the stream, not the host, waits for the CPU slices'
  # results (kvtier.kv.host_flag: the host's issuing off the CPU's path). The CUDA checks (their
  # CPU and int4-cpu rows: lossless with the new handoff), then auto int4 512K with the host's
  # wait (as every earlier row) and the stream's, on one start
  run 110 $py bench/gpu_checks.py
  for h in host gpu; do
    run 120 $py bench/tiered_store.py --contexts 512K --policies auto+int4 --cpu-attention auto \
      --full-prefill-max 1 --gpu-memory 24GiB --decode-steps 5 --trace-cpu --cpu-handoff $h \
      --name "cpu_attention_int4_512k_handoff_$h"
  done
  ;;
128)
  # (~7 min, no GGUF; right after 127) the stream's wait fused (as LLM runs), the g2/32-slice
  # timeline with it, lossless bf16 512K with it (0.624 s in the README, host's wait), and the
  # int4 slicings with the library's planned loads
  run 120 $py bench/tiered_store.py --contexts 512K --policies auto+int4 --cpu-attention auto \
    --full-prefill-max 1 --gpu-memory 24GiB --decode-steps 5 --trace-cpu --cpu-handoff gpu --fuse \
    --name cpu_attention_int4_512k_handoff_gpu_fused
  run 100 $py bench/tiered_store.py --contexts 512K --policies auto+int4 --cpu-attention 32 --head-group 2 \
    --full-prefill-max 1 --decode-steps 4 --trace-cpu --gpu-memory 24GiB --cpu-handoff gpu \
    --name int4_512k_g2_cpu32_timeline_handoff_gpu
  lossless_handoff_pair 150
  ;;
129)
  # (~8 min, no GGUF) issue 23: the stream's wait for CPU slices' results (opt-in,
  # StoreOptions.cpu_handoff="gpu") after c930068 (per-layer pinned buffers) and the host's
  # run-ahead bounded to one CPU layer: the two suspects of 128's hangs. The CUDA checks with
  # it on, then an A/B on one plan (two KV heads a slice, 32 CPU slices) and a traced step
  RUN_TAIL=60  # a watchdog's stacks, should a run hang again
  # Since 2026-12-07 also the results read in place by the merge (--cpu-results mapped,
  # kvtier.kv.mapped: no H2D copy to queue behind the link's loads); the checks run with both on
  KVTIER_CPU_HANDOFF=gpu KVTIER_CPU_RESULTS=mapped run 110 $py bench/gpu_checks.py
  for hr in host:copy gpu:copy gpu:mapped; do
    h=${hr%:*} r=${hr#*:}
    run 110 $py bench/tiered_store.py --contexts 512K --policies auto+int4 --cpu-attention 32 --head-group 2 \
      --full-prefill-max 1 --decode-steps 5 --trace-cpu --gpu-memory 24GiB --cpu-handoff $h --cpu-results $r \
      --watchdog 100 --name "int4_512k_g2_cpu32_handoff_${h}_$r"
  done
  # the stream's step under the profiler: do the layers' result copies queue behind the link's?
  run 110 $py bench/tiered_store.py --contexts 512K --policies auto+int4 --cpu-attention 32 --head-group 2 \
    --full-prefill-max 1 --decode-steps 3 --trace-step --gpu-memory 24GiB --cpu-handoff gpu \
    --watchdog 100 --name int4_512k_g2_cpu32_handoff_gpu_trace
  ;;
131)
  # (~8 min, no GGUF) issue 23 after 129 (000f6c1): with the results mapped the CPU idled 19 ms
  # a step between its layers (64 copied) but its jobs took 228 ms (191): does the int4 kernel
  # slow down beside the link's DMA (its rate alone and beside pinned H2D copies), and does
  # mapped beat copy over more steps (two runs each, interleaved, 12 steps)?
  run 110 $py bench/gpu_checks.py  # since 131 was written: runs of extents read in one copy
  run 100 $py bench/cpu_attention_rows.py --tokens 524288 --kv-heads 2 --threads 15 --bits 4 --no-fp8 \
    --reps 3 --combined --name cpu_attention_rows_int4_beside_h2d
  for i in $(seq 1 "${ROUNDS:-2}"); do  # ROUNDS=1: one round, where device time is short
    for r in copy mapped; do
      run 75 $py bench/tiered_store.py --contexts 512K --policies auto+int4 --cpu-attention 32 --head-group 2 \
        --full-prefill-max 1 --decode-steps 12 --trace-cpu --gpu-memory 24GiB --cpu-handoff gpu --cpu-results $r \
        --watchdog 70 --name "int4_512k_g2_cpu32_gpu_${r}_12steps_$i"
    done
  done
  # 129's host issued a layer in ~6.3 ms, busy all step beside 15 CPU threads on 16 cores: one
  # CPU thread fewer leaves the issuing thread a core of its own
  for r in copy mapped; do
    KVTIER_CPU_ATTENTION_THREADS=14 run 75 $py bench/tiered_store.py --contexts 512K --policies auto+int4 \
      --cpu-attention 32 --head-group 2 --full-prefill-max 1 --decode-steps 12 --trace-cpu --gpu-memory 24GiB \
      --cpu-handoff gpu --cpu-results $r --watchdog 70 --name "int4_512k_g2_cpu32_gpu_${r}_12steps_t14"
  done
  ;;
135)
  # (~3 min, no GGUF: call A, with the GGUF's first half) issue 19's exact fine-chunk scoring
  # (HipConfig.exact_chunk, `kvtier.sparse.triton_chunk_max`) on SmolLM2's 16K chunk beside
  # the bisection (hip_kernels_smollm2_16k_lean_skip.json: prune 5.70 ms, bisection 2.96)
  run 150 $py bench/hip_kernels.py --model smollm2-135m --preset lean --context 0 --chunk 16384 --heads 3 \
    --exact-chunk 8 --name hip_kernels_smollm2_16k_lean_exact
  ;;
136)
  # (~8 min, GGUF: call B) issue 19: SmolLM2's 16K HiP prefill with lean's 8-token stage scored
  # on every key (--hip-exact 8), beside lean and dense on one start, then its NIAH grids
  # (lean: prose 31/33 at 16K, 29/33 at 32K; repeat 33/33, 33/33)
  run 170 $py bench/hip_small_prefill.py --model smollm2-135m --lengths 16K --repeats 2 --new-tokens 8 \
    --methods "auto;hip;hip,hip_exact=8;hip,hip_exact=8,hip_strides=4/4/2" --name hip_small_prefill_exact
  niah_cuda prose hip,hip_exact=8 niah_smollm2_cuda_prose_hip_exact_x3
  niah_cuda repeat hip,hip_exact=8 niah_smollm2_cuda_repeat_hip_exact_x3
  ;;
137)
  # (~10 min, GGUF: call C) the embedded smoke's generate part with issue 23's new defaults and
  # its --cpu-attention row (133's), the CUDA checks with those defaults, then RULER 16K with
  # --hip-exact 8 (lean: 34.7)
  run 260 $py bench/gpu_smoke.py --models embedded --sections generate --jobs 4 --out "$OUT/gpu_smoke_generate_embedded.json"
  run 130 $py bench/gpu_checks.py
  run 200 kvtier eval ruler --lengths 16k --samples 10 --seed 0 --device cuda --method hip,hip_exact=8 \
    --no-progress --out "$OUT/ruler_smollm2_cuda_16k_lean_exact_x10.json"
  ;;
138)
  # (~9 min, GGUF: the prose prompt needs its tokenizer) issue 19's 512K prefill through the CLI
  # with lean's fine stages scored on every key: --hip-exact 8 (stage 2) and 16 (stages 1 and
  # 2) beside lean on one start (lean 5,195-5,709 tok/s, its chunks 1.9 s at the start of the
  # context where stage 2 bisects the whole chunk, 2.7 s at 512K: hip_cli_speed_512k_prefill_steps.json)
  run 560 $py bench/hip_cli_speed.py --contexts 512K --methods "hip;hip,hip_exact=8;hip,hip_exact=16" \
    --new-tokens 8 --timeout 170 --warmup-tokens 0 --name hip_cli_speed_512k_exact
  ;;
144)
  # (~6 min, no GGUF: one call where the GGUF's two-call setup does not fit the device time
  # left) the CUDA checks with the prefill by layer's rows, then its first GPU A/B: lossless
  # `auto` at 128K under 24 GiB prefilled in full through the runner, chunk and layer order
  run 170 $py bench/gpu_checks.py
  run 220 $py bench/tiered_store.py --contexts 128K --policies auto --full-prefill-max 128K \
    --gpu-memory 24GiB --decode-steps 2 --prefill-orders chunk,layer --name prefill_order_128k
  ;;
154)
  # (~9.5 min, GGUF: call B after 151) issue 19: what keeps --hip-exact 8 and --hip-stage0 256 off
  # by default. RULER 16K with stage-0 groups (exact 8 alone: 35.5, lean 34.7), then where
  # SmolLM2's 16K prefill goes with exact 8 (0.216-0.235x dense), profiled
  # the stage after stages that kept everything reads its candidates by position (the span
  # unmaterialized: lean's 8-token stage at 16K); lean 67,473, exact 8 84,173-85,499 before
  run 100 $py bench/hip_small_prefill.py --model smollm2-135m --lengths 16K --repeats 2 --new-tokens 8 \
    --methods "auto;hip;hip,hip_exact=8" --name hip_small_prefill_span
  run 200 kvtier eval ruler --lengths 16k --samples 10 --seed 0 --device cuda --method hip,hip_exact=8,hip_stage0=256 \
    --no-progress --out "$OUT/ruler_smollm2_cuda_16k_lean_exact_stage0_x10.json"
  run 90 $py bench/hip_small_prefill.py --model smollm2-135m --lengths 16K --repeats 1 --new-tokens 8 \
    --methods "auto;hip,hip_exact=8" --profile --name hip_small_prefill_exact_profile
  run 150 $py bench/hip_cli_speed.py --contexts 512K --methods "hip,hip_preset=fast,prefill_order=layer" \
    --new-tokens 64 --timeout 140 --warmup-tokens 0 --name hip_cli_speed_512k_fast_by_layer_decode
  ;;
155)
  # (~7 min, GGUF for the prompt's tokenizer; after 154 on the same start) lean at 512K chunk by
  # chunk with and without --hip-exact 8 (lean alone 5,195-5,709 tok/s on earlier starts; by
  # layer with exact 8 5,094): whether exact 8 can become lean's default
  run 400 $py bench/hip_cli_speed.py --contexts 512K --methods "hip;hip,hip_exact=8" \
    --new-tokens 8 --timeout 190 --warmup-tokens 0 --name hip_cli_speed_512k_lean_exact_ab
  ;;
156)
  # (~6.5 min, no GGUF) issue 19's 512K ratio: a 16K chunk early in the context takes ~0.85 s for
  # both HiP and lossless (~52 us a token; the matmuls' bound is ~20), so ~0.83 s a chunk does
  # not grow with the context and 5x needs it cut. Profiled through LLM's tiered prefill under
  # 24 GiB at 64K, lossless and fast: the top kernels and the GPU's idle time
  run 220 $py bench/hip_small_prefill.py --model llama-3-8b --lengths 64K --gpu-memory 24GiB --new-tokens 2 \
    --repeats 1 --methods "auto;hip,hip_preset=fast" --profile --name prefill_profile_llama8b_64k_24gib
  # SmolLM2's 16K lean pruning with exact 8: the exact kernel's chunks a program (32, its
  # default, against 64/128/256: a program reloads its block's queries for every 256 candidates)
  run 150 $py bench/hip_kernels.py --model smollm2-135m --preset lean --context 0 --chunk 16384 --heads 3 \
    --exact-chunk 8 --name hip_kernels_smollm2_16k_lean_exact_block_c
  ;;
158)
  # (~9.5 min, GGUF: the prose prompt's tokenizer and the NIAH grid) issue 19: stage 0 on landmark
  # keys (--hip-landmarks on: one key a chunk in a dense product, not a bisection per query
  # block). 512K through the CLI beside fast (13,118 tok/s, 3.49x lossless' 3,766 on one H100
  # start); then NIAH on the embedded model at 64K, where stage 0 prunes (up to ~33K its 32K
  # budget keeps everything, so the 16K/32K grids never reach the landmark stage), lean with
  # and without landmarks on the same grid
  run 330 $py bench/hip_cli_speed.py --contexts 512K \
    --methods "hip,hip_preset=fast;hip,hip_preset=fast,hip_landmarks=on" \
    --new-tokens 8 --timeout 150 --warmup-tokens 0 --name hip_cli_speed_512k_fast_landmarks
  run 220 kvtier eval niah --lengths 64k --depths 0:100:10 --samples 3 --haystack prose --device cuda \
    --max-model-len 66000 --method hip --method hip,hip_landmarks=on --no-progress \
    --out "$OUT/niah_smollm2_cuda_prose_64k_hip_landmarks_x3.json"
  ;;
157)
  # (~5 min, GGUF for the prompt's tokenizer) issue 19's 512K prefill: fast's 8-token stage (7.2
  # of its 25.3 ms pruning a layer, 8,192 candidates of 256 rows) scored exactly (exact 32 made
  # stages 1 and 2 slower: hip_cli_speed_512k_exact_by_layer.json), alone and with stage-0 groups
  # (fast 13,118, with groups 14,049 tok/s: hip_cli_speed_512k_fast_stage0_rev.json)
  run 290 $py bench/hip_cli_speed.py --contexts 512K \
    --methods "hip,hip_preset=fast,hip_exact=8;hip,hip_preset=fast,hip_exact=8,hip_stage0=256" \
    --new-tokens 8 --timeout 135 --warmup-tokens 0 --name hip_cli_speed_512k_fast_exact8
  ;;
183)
  # (ran 2026-12-08, fifty-ninth session, code 37c7fc2)
  # (~4 min; after 182, the GGUF in place) the embedded smoke's generate section with the
  # warm-up on by default (95a8615's 38/38 ran with it off)
  run 230 $py bench/gpu_smoke.py --models embedded --sections generate --jobs 4 \
    --out "$OUT/gpu_smoke_embedded_generate_warm.json"
  # (~2 min more) KVTIER_HOST_PIN=huge, the host tier in registered huge pages (182's
  # host_memory.json says how fast each pins and reads): 181's 512K row again, its setup_s
  # and prefill against 181's (another call, the same start)
  lm="hip,hip_preset=fast,hip_landmarks=on,prefill_order=layer,hip_probes=on,hip_stage0=256"
  KVTIER_HOST_PIN=huge KVTIER_HIDDEN_PIN=register cli512k 115 "$lm" \
    hip_cli_speed_512k_fast_landmarks_layer_probes_stage0_huge
  ;;
182)
  # (ran 2026-12-08, fifty-ninth session, code 37c7fc2)
  # (~7 min; right after 181 on the same start; .gguf_b and .whl carried: `source
  # bench/h200_setup.sh` joins the halves) the 64K needles of 181's row (probes and stage-0
  # groups; probes alone 15 of 33), then the embedded smoke's plan, eval and serve sections with
  # the warm-up on by default (the server now warms before its decode graphs)
  niah64k 150 "hip,hip_preset=fast,hip_landmarks=on,hip_probes=on,hip_stage0=256" \
    niah_smollm2_cuda_prose_64k_fast_landmarks_probes_stage0_x3
  run 260 $py bench/gpu_smoke.py --models embedded --sections plan,eval,serve --jobs 4 \
    --out "$OUT/gpu_smoke_embedded_plan_eval_serve.json"
  # whether huge pages make registered host memory both quick to pin and quick to read in place
  # (the 512K setup pins ~68 GB at ~2.3 GB/s through cudaHostAlloc)
  run 90 $py bench/host_memory.py --total 8GiB --piece 1GiB --name host_memory
  ;;
181)
  # (ran 2026-12-08, fifty-ninth session, code 37c7fc2)
  # (~8 min; .tok/ and .gguf_a carried (with .whl the carry passes 64 MiB; nothing here needs
  # a wheel): call A of the GGUF's two, 182 at once after it)
  mkdir -p /tmp/gg && cp .gguf_a/gguf_part_aa /tmp/gg/
  # issue 19's 5x at 512K without a quality cost: the
  # probes row (15 of 33 needles at 64K, as fast with landmarks) with stage-0 groups made 4.32x
  # in 180's start, its layer 4 compiling (1.74 s against ~0.88): a 64K warm-up of exactly its
  # kernels, the row again, then lossless auto with the warm-up (now the default) as its base
  lm="hip,hip_preset=fast,hip_landmarks=on,prefill_order=layer,hip_probes=on,hip_stage0=256"
  KVTIER_HIDDEN_PIN=register run 130 $py bench/hip_cli_speed.py --contexts 64K --warmup-tokens 0 \
    --methods "$lm" --new-tokens 2 --timeout 125 --name hip_cli_speed_64k_warmup_181
  KVTIER_HIDDEN_PIN=register cli512k 115 "$lm" hip_cli_speed_512k_fast_landmarks_layer_probes_stage0_b
  cli512k 240 auto hip_cli_speed_512k_auto_base_h
  # whether pinning holds another thread's CUDA calls (a prefill beside a background pinning of
  # the host tier would save a 512K run's ~25-30 s of setup): bench/pin_rate.py's beside_* fields
  run 60 $py bench/pin_rate.py --configs cudaHostAlloc --threads 1 --total 4GiB --piece 1GiB \
    --name pin_rate_beside
  ;;
178)
  # (ran 2026-12-07, fifty-eighth session, code 95a8615, with 179 and 180 on one start)
  # (~8 min, no GGUF: .tok/ and .whl carried; the fifty-seventh's 175 and 177 (removed, never run) trimmed to what one call of a session's
  # ~25 min fits) issue 19's 5x at 512K on one start: a 64K warm-up with every kernel the rows use,
  # the combined row with stage 0 once per 4 query blocks (5x is 28.35 s against the combined
  # row's 29.02), where a run's first prefill step's extra ~1.6 s goes (auto's first chunk of the
  # 64K prompt under cProfile and torch.profiler), then lossless auto, the ratios' base
  lm="hip,hip_preset=fast,hip_landmarks=on,prefill_order=layer"
  all3="$lm,hip_probes=on,hip_strides=4/4/2"
  KVTIER_HIDDEN_PIN=register run 130 $py bench/hip_cli_speed.py --contexts 64K --warmup-tokens 0 \
    --methods "$all3,hip_stage0=256" --new-tokens 2 --timeout 125 --name hip_cli_speed_64k_warmup_178
  KVTIER_HIDDEN_PIN=register cli512k 115 "$all3,hip_stage0=256" hip_cli_speed_512k_fast_landmarks_layer_combined_stage0
  run 80 $py bench/first_decode_trace.py --any-step --step 1 --name first_prefill_step_trace_64k_auto -- \
    --model /tmp/kvtier-smoke/llama-3.1-8b-random --prompt-file /tmp/kvtier-smoke/prose_65536.txt \
    --gpu-memory 24GiB --max-new-tokens 1 --max-model-len 2M --ignore-eos
  cli512k 240 auto hip_cli_speed_512k_auto_base_g
  ;;
179)
  # (ran 2026-12-07, fifty-eighth session, code 95a8615)
  # (~4 min; right after 178 on the same start; .gguf_a carried: call A of the GGUF's two) the
  # first prefill step's trace again with the GPU libraries warmed beside the setup
  # (KVTIER_WARMUP=thread, kvtier.engine.warmup: its first step beside 178's), then the combined
  # row with the warm-up and its host tier's slabs pinned from 8 threads (its layer 0 and setup_s
  # beside 178's rows: 31-35 s one slab after another), and the GGUF's first half to /tmp/gg
  mkdir -p /tmp/gg && cp .gguf_a/gguf_part_aa /tmp/gg/
  KVTIER_WARMUP=thread run 80 $py bench/first_decode_trace.py --any-step --step 1 \
    --name first_prefill_step_trace_64k_auto_warm -- \
    --model /tmp/kvtier-smoke/llama-3.1-8b-random --prompt-file /tmp/kvtier-smoke/prose_65536.txt \
    --gpu-memory 24GiB --max-new-tokens 1 --max-model-len 2M --ignore-eos
  KVTIER_WARMUP=thread KVTIER_HIDDEN_PIN=register KVTIER_PIN_THREADS=8 cli512k 115 \
    "hip,hip_preset=fast,hip_landmarks=on,prefill_order=layer,hip_probes=on,hip_strides=4/4/2,hip_stage0=256" \
    hip_cli_speed_512k_fast_landmarks_layer_combined_stage0_warm_pin8
  ;;
180)
  # (ran 2026-12-07, fifty-eighth session, code 95a8615: 11 of 33 needles for both rows)
  # (~8 min; right after 179; .gguf_b and .whl carried: `source bench/h200_setup.sh` joins the
  # halves) the 64K needles of 178's row and of the combined row (bar: 15 of 33), then the
  # embedded model's smoke (GPU-facing code changed: graph capture, pin and load bars)
  bash bench/pending_h200.sh 176
  niah64k 120 "hip,hip_preset=fast,hip_landmarks=on,hip_probes=on,hip_strides=4/4/2" \
    niah_smollm2_cuda_prose_64k_fast_landmarks_hip_probes_on_hip_strides_4_4_2_x3
  run 200 $py bench/gpu_smoke.py --models embedded --sections generate --jobs 4 \
    --out "$OUT/gpu_smoke_embedded_generate.json"
  ;;
176)
  # (~3 min, the GGUF; after 173) the 64K needles of 178's 512K row (ran within 180): probes, strides 4/4/2 and
  # stage 0 once per 4 query blocks
  niah64k 150 "hip,hip_preset=fast,hip_landmarks=on,hip_probes=on,hip_strides=4/4/2,hip_stage0=256" \
    niah_smollm2_cuda_prose_64k_fast_landmarks_probes_strides442_stage0_x3
  ;;
171)
  # (ran 2026-12-07, fifty-seventh session, code 60b31e2: its 512K `on` row cut by the 190 s limit
  # after the warm-up; hip_cli_speed_512k_fast_landmarks_layer_{on,hidden_register,probes,strides442}.json)
  # (~8 min, no GGUF: .tok/ and .whl carried) issue 19's 512K prefill with landmarks by layer
  # (on: the prompt's last token bisects; 14,901 tok/s, 4.01x in 166), four rows on one start
  # after a 64K warm-up that pays Triton's compiles: as is; with the hidden states' pieces pinned
  # by cudaHostRegister (KVTIER_HIDDEN_PIN=register, kvtier.engine.host_pin: layer 0 pinned 4.3 GB
  # at cudaHostAlloc's 1.59 GB/s, 2.77 s against ~0.9 for a later layer in 169); with decode's
  # stages on probes (--hip-probes on: the last token's stage-0 probes read in place, ~1/16 of the
  # keys, the bisection's selection, where `all`'s landmarks cost needles: 0.80 s, 11 of 33 at
  # 64K against 15); with stage 2's queries pooled by 2 (--hip-strides 4/4/2: stage 2 was 7.6 of
  # the pruning's 13.2 ms a layer, hip_kernels_512k_fast_landmarks_triton.json). 172 right after
  lm="hip,hip_preset=fast,hip_landmarks=on,prefill_order=layer"
  cli512k 190 "$lm" hip_cli_speed_512k_fast_landmarks_layer_on --warmup-context 64K --warmup-tokens 2
  KVTIER_HIDDEN_PIN=register cli512k 130 "$lm" hip_cli_speed_512k_fast_landmarks_layer_hidden_register
  cli512k 130 "$lm,hip_probes=on" hip_cli_speed_512k_fast_landmarks_layer_probes
  cli512k 130 "$lm,hip_strides=4/4/2" hip_cli_speed_512k_fast_landmarks_layer_strides442
  ;;
172)
  # (ran 2026-12-07, fifty-seventh session, code 60b31e2: hip_cli_speed_512k_auto_base_f.json,
  # _fast_landmarks_layer_combined.json, first_decode_trace_512k_fast_landmarks_layer.json)
  # (~8 min, no GGUF: .tok/ carried; right after 171 on the same start) lossless auto at 512K,
  # the base of 171's ratios, then 171's three changes together
  cli512k 250 auto hip_cli_speed_512k_auto_base_f
  KVTIER_HIDDEN_PIN=register cli512k 140 \
    "hip,hip_preset=fast,hip_landmarks=on,prefill_order=layer,hip_probes=on,hip_strides=4/4/2" \
    hip_cli_speed_512k_fast_landmarks_layer_combined
  # the first decode step after a prefill by layer took 0.61-0.94 s in every such run (0.08-0.15
  # by chunk: hip_cli_speed_512k_fast_order_ab.json) with the same graph captures and mallocs;
  # torch.cuda.graph unpins PyTorch's cached pinned blocks, there the layer order's 4.3 GB of
  # hidden pieces, which kvtier.kv.graph_capture now keeps: 171's first decode steps say whether
  # that was it, and this traces that step (cProfile, torch.profiler; 171 left the prompt and model)
  run 130 $py bench/first_decode_trace.py --name first_decode_trace_512k_fast_landmarks_layer -- \
    --model /tmp/kvtier-smoke/llama-3.1-8b-random --prompt-file /tmp/kvtier-smoke/prose_524288.txt \
    --gpu-memory 24GiB --max-new-tokens 4 --max-model-len 2M --ignore-eos --attention hip \
    --hip-preset fast --hip-landmarks on --prefill-order layer
  ;;
173)
  # (~3 min, the GGUF) the quality of 171's rows: SmolLM2's prose NIAH at 64K (15 of 33 for fast
  # and fast with landmarks on; 11 for all): with probes, and with probes and strides 4/4/2
  for extra in hip_probes=on hip_probes=on,hip_strides=4/4/2; do
    run 120 kvtier eval niah --lengths 64k --depths 0:100:10 --samples 3 --first-sample 0 --seed 0 \
      --haystack prose --device cuda --max-model-len 66000 --no-progress \
      --method "hip,hip_preset=fast,hip_landmarks=on,$extra" \
      --out "$OUT/niah_smollm2_cuda_prose_64k_fast_landmarks_${extra//[=,\/]/_}_x3.json"
  done
  ;;
174)
  # (~2 min, no GGUF) whether pinning scales with threads: a 512K run's setup pins its 64 GiB
  # host tier as 1 GiB slabs one after another (24.5 s, ~2.8 GB/s: hip_cli_speed_512k_fast_
  # landmarks_all_layer.json), and cudaHostRegister's faster pinning made in-place reads slower;
  # if cudaHostAlloc from 8 threads pins several times faster, HostArena could make its slabs so
  run 150 $py bench/pin_rate.py --configs cudaHostAlloc --threads 1,8 --total 8GiB --piece 1GiB \
    --name pin_rate_threads
  ;;
169)
  # (ran 2026-12-07, fifty-sixth session, code c927cc2: pin_rate.json,
  # hip_cli_speed_512k_fast_landmarks_all_layer{,_register16}.json; the first row was cut)
  # (~7 min, no GGUF: .tok/ and .whl carried) how fast pinned memory is made and whether making
  # it stalls the GPU (a 512K run's wall is ~55 s past its prefill and decode, most of it perhaps
  # pinning the 64 GiB host tier; the layer order's layer 0 pins the hidden states, 4.3 GB: 4.06 s
  # against ~0.94 for a later layer in 166); then issue 19's 512K prefill with landmarks by layer
  # after the prompt's last token scores stage 0 on the landmarks too (kvtier.sparse.prompt_stage0:
  # landmark rows and kept chunks over PCIe, not every key; its step was 1.59 s in 166), three
  # times on one start: the first pays Triton's compiles, the second pins with malloc +
  # cudaHostRegister on 16 threads, the third as the first (the A/B of the second). 170 right after
  run 90 $py bench/pin_rate.py --name pin_rate
  lm="hip,hip_preset=fast,hip_landmarks=on,prefill_order=layer"
  run 140 $py bench/hip_cli_speed.py --contexts 512K --warmup-tokens 0 --methods "$lm" \
    --new-tokens 8 --timeout 135 --name hip_cli_speed_512k_fast_landmarks_layer_f148_a
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True,pinned_use_cuda_host_register:True,pinned_num_register_threads:16 \
    run 140 $py bench/hip_cli_speed.py --contexts 512K --warmup-tokens 0 --methods "$lm" \
    --new-tokens 8 --timeout 135 --name hip_cli_speed_512k_fast_landmarks_layer_register16
  run 140 $py bench/hip_cli_speed.py --contexts 512K --warmup-tokens 0 --methods "$lm" \
    --new-tokens 8 --timeout 135 --name hip_cli_speed_512k_fast_landmarks_layer_f148_b
  ;;
170)
  # (ran 2026-12-07, fifty-sixth session: hip_cli_speed_512k_auto_base_e.json, _fast_layer.json)
  # (~6 min, no GGUF: .tok/ carried; right after 169 on the same start) lossless auto at 512K,
  # the base of 169's ratios, then fast by layer without landmarks: which of landmarks and the
  # layer order made 166's 14,901 tok/s (fast by chunk: 13,203), and whether the layer order
  # should be HiP's default
  run 250 $py bench/hip_cli_speed.py --contexts 512K --warmup-tokens 0 --methods "auto" \
    --new-tokens 8 --timeout 240 --name hip_cli_speed_512k_auto_f148
  run 140 $py bench/hip_cli_speed.py --contexts 512K --warmup-tokens 0 \
    --methods "hip,hip_preset=fast,prefill_order=layer" --new-tokens 8 --timeout 135 \
    --name hip_cli_speed_512k_fast_layer_f148
  ;;
168)
  # (~7 min, no GGUF: .tok/ and .whl carried; ran 2026-12-07, fifty-fifth session, its fast-by-chunk
  # row cut by the 300 s limit) issue 19's 512K prefill by layer with landmarks after
  # the hidden states' pieces were pinned before the first launch (each pinned at its chunk's first
  # write synchronized the device: layer 0 took 4.06 s against 0.94) and written back without
  # record_stream (1,228 cudaMallocs and 210 allocator retries against 68 and none by chunk): it
  # made 14,901 tok/s, 4.01x auto, in 166 (hip_cli_speed_512k_fast_landmarks_triton.json). The
  # warm-up at 64K, where stage 0 prunes, pays Triton's compile; fast by chunk after it, whose
  # ratio to lossless auto on one start 166/167 measured (3.56x); then the embedded smoke
  run 300 $py bench/hip_cli_speed.py --contexts 512K --warmup-context 64K --warmup-tokens 2 \
    --methods "hip,hip_preset=fast,hip_landmarks=on,prefill_order=layer;hip,hip_preset=fast" \
    --new-tokens 8 --timeout 170 --name hip_cli_speed_512k_fast_landmarks_layer
  ;;
166)
  # (~8 min, no GGUF: .tok/ and .whl carried; ran 2026-12-07, fifty-fifth session) issue 19's 512K prefill through the CLI after the
  # landmarks' Triton kernels (cc10f06: the pruning 13.44 ms a layer with stage 0 on landmarks
  # against 22.18 with the bisection, key scores 0.88 ms: hip_kernels_512k_fast_landmarks_triton.json),
  # fast with landmarks first (it pays Triton's compile), fast, and landmarks by layer: with less
  # compute a late chunk's copies of the whole KV (~64 GB at 55 GB/s, 1.17 s) bound it again,
  # which the layer order does not make (its layer 0 took 7.3 s at 35f8c09, now without a whole
  # 8 GB pinned buffer for the hidden states: a piece a chunk); then what stage 2 (7.6 ms a layer, the largest part
  # left) costs scored exact. 167 right after, on the same start: lossless auto beside them
  run 420 $py bench/hip_cli_speed.py --contexts 512K \
    --methods "hip,hip_preset=fast,hip_landmarks=on;hip,hip_preset=fast;hip,hip_preset=fast,hip_landmarks=on,prefill_order=layer" \
    --new-tokens 8 --timeout 170 --warmup-tokens 0 --name hip_cli_speed_512k_fast_landmarks_triton
  run 90 $py bench/hip_kernels.py --context 512K --chunk 16384 --heads 8 --preset fast --landmarks \
    --exact-chunk 8 --name hip_kernels_512k_fast_landmarks_exact8
  ;;
167)
  # (~6 min, no GGUF: .tok/ carried; right after 166 on the same start; ran 2026-12-07) lossless auto at 512K
  # for 166's ratios; SmolLM2's 16K chunk under lean with exact 8 and pooled pairs, kernel by kernel
  run 260 $py bench/hip_cli_speed.py --contexts 512K --methods "auto" --new-tokens 8 --timeout 245 \
    --warmup-tokens 0 --name hip_cli_speed_512k_auto_base_d
  run 90 $py bench/hip_kernels.py --model smollm2-135m --preset lean --context 0 --chunk 16384 --heads 3 \
    --exact-chunk 8 --strides 4/4/2 --name hip_kernels_smollm2_16k_lean_exact8_strides
  ;;
164)
  # (~8 min, no GGUF: .tok/ and .whl carried; ran 2026-12-07, fifty-fourth session) issue 19's 512K prefill through the CLI after the
  # landmark key scores' blocked running sums (8.3 ms a 16K chunk of 8 KV heads on an H100, 6.9
  # of it one float64 cumsum along dim 0: hip_kernels_128k_fast_landmarks.json): fast with
  # landmarks first (it pays Triton's compile), fast, and fast with landmarks and stage 2 on
  # queries pooled in pairs (7.2 of fast's 25.3 ms pruning a slice at 512K is stage 2 over
  # unpooled rows: hip_kernels_512k_fast_stages.json)
  run 450 $py bench/hip_cli_speed.py --contexts 512K \
    --methods "hip,hip_preset=fast,hip_landmarks=on;hip,hip_preset=fast;hip,hip_preset=fast,hip_landmarks=on,hip_strides=4/4/2" \
    --new-tokens 8 --timeout 140 --warmup-tokens 0 --name hip_cli_speed_512k_fast_landmarks_blocked
  run 120 $py bench/hip_kernels.py --context 512K --chunk 16384 --heads 8 --preset fast --landmarks \
    --name hip_kernels_512k_fast_landmarks
  ;;
165)
  # (~7 min, GGUF: the embedded model; call B after the GGUF's first half; ran 2026-12-07,
  # fifty-fourth session, its JSONs lost but the NIAH's rerun) the quality of what
  # 164 times: NIAH on the embedded SmolLM2 (CUDA, prose, 11 depths x 3 samples) at 64K, where
  # stage 0 prunes, fast with landmarks and with landmarks and strides 4/4/2 beside fast; then
  # 64K fast under 24 GiB after auto in one process (it ran out of memory in its warm-up decode
  # on 2026-12-07), each case recording what earlier ones left allocated
  run 300 kvtier eval niah --lengths 64k --depths 0:100:10 --samples 3 --haystack prose --device cuda \
    --max-model-len 66000 --method hip,hip_preset=fast --method hip,hip_preset=fast,hip_landmarks=on \
    --method hip,hip_preset=fast,hip_landmarks=on,hip_strides=4/4/2 --no-progress \
    --out "$OUT/niah_smollm2_cuda_prose_64k_fast_landmarks_x3.json"
  run 150 $py bench/hip_small_prefill.py --model llama-3-8b --lengths 64K --gpu-memory 24GiB --new-tokens 2 \
    --repeats 1 --methods "auto;hip,hip_preset=fast;auto" --name prefill_llama8b_64k_24gib_held
  ;;
163)
  # (~5 min, no GGUF: .tok/ and .whl carried; ran 2026-12-07, fifty-third session) the 512K CLI
  # A/B in the ~550 s of device time seven refused starts left: fast with landmarks first, then fast
  run 300 $py bench/hip_cli_speed.py --contexts 512K \
    --methods "hip,hip_preset=fast,hip_landmarks=on;hip,hip_preset=fast" \
    --new-tokens 8 --timeout 140 --warmup-tokens 0 --name hip_cli_speed_512k_fast_landmarks_sums
  ;;
160)
  # (~7 min, no GGUF) the fifty-second
  # session's NEXT for issue 19: stage 0 on landmark keys made fast's 512K prefill slower through
  # the CLI (11,911 against 12,733 tok/s: hip_cli_speed_512k_fast_landmarks.json) where it should
  # replace the bisection's 13.9 of 25.3 ms a layer; its key scores then took 796 torch operators
  # a 16K chunk's slice (now running sums: 89). One 16K chunk at 512K, a layer's 8 KV heads:
  # the pruning on landmarks, stage by stage, the chunk's key scores, and both profiled; then the tiered prefill of the whole 512K
  # with and without landmarks, profiled (landmarks first: it pays Triton's first compile)
  run 150 $py bench/hip_kernels.py --context 512K --chunk 16384 --heads 8 --preset fast --landmarks \
    --name hip_kernels_512k_fast_landmarks
  run 260 $py bench/hip_offload.py --contexts 512K --presets "fast+landmarks=1,fast" --policy planned \
    --no-dense --steps 0 --prefill-chunk 16384 --profile --name hip_offload_prefill_512k_fast_landmarks
  ;;
159)
  # (~6 min, no GGUF: call A, carrying the GGUF's first half) the pruning kernels on CUDA after the
  # row tiles (64 KiB of queries a tile), the implicit span (a stage after stages that kept
  # everything reads its candidates by position) and the exact kernel's settings; then issue 19's
  # landmark stage 0 at 512K in the tiered prefill beside fast (landmarks first: it pays Triton's
  # first compile): whether it cuts stage 0's 13.9 of fast's 25.3 ms a layer; then 156's profile of
  # a 64K prefill under 24 GiB (lossless and fast: ~52 us a token early in both, twice the matmuls'
  # bound) if the call's time allows
  run 120 $py -m pytest -q -p no:cacheprovider tests/test_triton_bisect.py tests/test_chunk_max.py
  run 270 $py bench/hip_offload.py --contexts 512K --presets "fast+landmarks=1,fast" --policy planned \
    --no-dense --steps 0 --name hip_offload_prefill_512k_fast_landmarks
  run 160 $py bench/hip_small_prefill.py --model llama-3-8b --lengths 64K --gpu-memory 24GiB --new-tokens 2 \
    --repeats 1 --methods "auto;hip,hip_preset=fast" --profile --name prefill_profile_llama8b_64k_24gib
  ;;
151)
  # (~3 min, no GGUF: call A, carrying the GGUF's first half) the CUDA checks (the layer pass's
  # hidden states now allocated on the compute stream; stage-0 groups), then the pruning kernel's
  # row tiles capped at 64 KiB of queries on CUDA (--hip-stage0 1024's one 1,024-row tile had
  # overflowed shared memory: hip_cli_speed_512k_fast_stage0_more.json)
  run 170 $py bench/gpu_checks.py
  run 100 $py -m pytest -q -p no:cacheprovider tests/test_triton_bisect.py -k tiles
  ;;
152)
  # (~9.5 min, GGUF: call B after 151) issue 19 on SmolLM2 at 16K: --hip-stage0 256 (stage 0
  # once per 4 query blocks) beside --hip-exact 8 alone (0.235x dense) and with 4/4/2 (0.258x),
  # the NIAH of the fastest mix, then RULER 16K and the pass key with exact 8 (lean: 34.7;
  # 10/10 at 16K and 32K)
  run 140 $py bench/hip_small_prefill.py --model smollm2-135m --lengths 16K --repeats 2 --new-tokens 8 \
    --methods "auto;hip,hip_exact=8;hip,hip_exact=8,hip_stage0=256;hip,hip_exact=8,hip_strides=4/4/2,hip_stage0=256" \
    --name hip_small_prefill_stage0
  niah_cuda prose hip,hip_exact=8,hip_stage0=256 niah_smollm2_cuda_prose_hip_exact_stage0_x3
  run 190 kvtier eval ruler --lengths 16k --samples 10 --seed 0 --device cuda --method hip,hip_exact=8 \
    --no-progress --out "$OUT/ruler_smollm2_cuda_16k_lean_exact_x10.json"
  run 100 kvtier eval passkey --lengths 16k,32k --samples 10 --device cuda --max-model-len 33000 \
    --method hip,hip_exact=8 --no-progress --out "$OUT/passkey_smollm2_cuda_hip_exact_x10.json"
  ;;
153)
  # (~6 min, GGUF: the prose prompt's tokenizer; after 152 on the same start) issue 19's 512K
  # prefill through the CLI: fast (13,176 tok/s, hip_cli_speed_512k_fast_order_ab.json) beside
  # fast with stage 0 once per 256 queries (4x fewer stage-0 key reads; the prefill there is
  # compute-bound, ~60% of it bisection)
  run 360 $py bench/hip_cli_speed.py --contexts 512K \
    --methods "hip,hip_preset=fast,hip_stage0=256;hip,hip_preset=fast" \
    --new-tokens 8 --timeout 175 --warmup-tokens 0 --name hip_cli_speed_512k_fast_stage0
  ;;
149)
  # (~8.5 min, no GGUF; 150 is its lean half) issue 19 at 512K: HiP's prefill there is
  # compute-bound (13,176 tok/s for `fast` chunk by chunk, by layer no faster:
  # hip_cli_speed_512k_fast_order_ab.json), its bisection ~60% of a chunk; stage 0 alone reads
  # every key, 16 pooled queries a block (each stage's share: hip_kernels below). One 16K chunk at
  # the end of 512K (structured KV, the engine's plan) with stage 0's queries pooled 16 and 64 a
  # score, and stage 0 once per 256 queries (4 blocks: `HipConfig.stage0_block_q`, hip-attention's
  # per-stage query block), which cuts stage 0's key reads 4x where pooling cuts only its rows
  run 360 $py bench/hip_offload.py --contexts 512K --presets "fast,fast+strides=16/4/1,fast+strides=64/4/1,fast+stage0=256" \
    --policy planned --no-dense --steps 0 --prefill-chunk 16384 --name hip_offload_prefill_512k_fast_strides
  # each stage's share of `fast`'s pruning of one 16K chunk at 512K, a layer slice of 8 KV heads
  run 150 $py bench/hip_kernels.py --preset fast --context 512K --chunk 16384 --heads 8 \
    --name hip_kernels_512k_fast_stages
  ;;
150)
  # (~5 min, no GGUF: 149's other half)
  # `lean` (what `auto` runs past the trained length): its last stage's queries pooled in pairs
  # (NIAH 16K/32K 31, 30 of 33 against its 30, 29; RULER 16K 33.2 against 34.7) and scored exactly
  run 300 $py bench/hip_offload.py --contexts 512K --presets "lean,lean+strides=4/4/2,lean+exact=8,lean+stage0=256" \
    --policy planned --no-dense --steps 0 --prefill-chunk 15360 --name hip_offload_prefill_512k_lean_strides
  ;;
148)
  # (~9 min, GGUF: call B after 145) the fiftieth session's NEXT for issue 19: where SmolLM2's 16K
  # prefill goes with --hip-exact 8 (0.235x dense, hip_small_prefill_exact.json), RULER 16K and
  # the pass key with it (lean: 34.7; 10/10 at 16K and 32K), then the first decode steps after a
  # prefill by layer over 64 tokens (7 steps after it: one slow first step, 0.75-1.4 s)
  run 90 $py bench/hip_small_prefill.py --model smollm2-135m --lengths 16K --repeats 1 --new-tokens 8 \
    --methods "auto;hip,hip_exact=8" --profile --name hip_small_prefill_exact_profile
  run 200 kvtier eval ruler --lengths 16k --samples 10 --seed 0 --device cuda --method hip,hip_exact=8 \
    --no-progress --out "$OUT/ruler_smollm2_cuda_16k_lean_exact_x10.json"
  run 110 kvtier eval passkey --lengths 16k,32k --samples 10 --device cuda --max-model-len 33000 \
    --method hip,hip_exact=8 --no-progress --out "$OUT/passkey_smollm2_cuda_hip_exact_x10.json"
  run 150 $py bench/hip_cli_speed.py --contexts 512K --methods "hip,hip_preset=fast,prefill_order=layer" \
    --new-tokens 64 --timeout 140 --warmup-tokens 0 --name hip_cli_speed_512k_fast_by_layer_decode
  ;;
145)
  # (~3 min, no GGUF: call A, carrying the GGUF's first half) the CUDA checks with the prefill
  # by layer's rows (bitwise against the chunk order, dense and HiP)
  run 170 $py bench/gpu_checks.py
  ;;
146)
  # (~6 min, GGUF: call B) issue 19's 512K prefill through the CLI by layer, with the last
  # stages scored exactly: lean + exact 8, fast + exact 32 (chunk by chunk: lean 5,195-5,709,
  # fast 11,682 tok/s on an H100, hip_cli_speed_512k_prefill_steps.json; lossless `auto`
  # 3,692 on an H200, hip_cli_speed_512k.json)
  run 380 $py bench/hip_cli_speed.py --contexts 512K \
    --methods "hip,hip_exact=8,prefill_order=layer;hip,hip_preset=fast,hip_exact=32,prefill_order=layer" \
    --new-tokens 8 --timeout 185 --warmup-tokens 0 --name hip_cli_speed_512k_exact_by_layer
  ;;
147)
  # (~4.5 min, GGUF: after 146 or 148, on the same start) the ratio's base on the card the HiP
  # runs got: lossless `auto` at 512K through the CLI as users run it, chunk by chunk (3,692
  # tok/s on an H200, hip_cli_speed_512k.json; HiP `fast` 13,176 on an H100,
  # hip_cli_speed_512k_fast_order_ab.json). By layer gained HiP nothing there (compute-bound).
  run 270 $py bench/hip_cli_speed.py --contexts 512K --methods "auto" \
    --new-tokens 4 --timeout 260 --warmup-tokens 0 --name hip_cli_speed_512k_auto_base
  ;;
141)
  # (~5 min, no GGUF: call A, with the GGUF's first half) the CUDA checks with the prefill by
  # layer (`--prefill-order layer`: its hidden states through pinned memory on two copy streams,
  # bitwise against the chunk order, dense and HiP), then 135 (the exact fine-chunk kernel)
  run 150 $py bench/gpu_checks.py
  run 150 $py bench/hip_kernels.py --model smollm2-135m --preset lean --context 0 --chunk 16384 --heads 3 \
    --exact-chunk 8 --name hip_kernels_smollm2_16k_lean_exact
  ;;
142)
  # (~9 min, GGUF: call B) issue 19's 512K prefill through the CLI on one start: lean as it is
  # (5,195-5,709 tok/s), with its last stage scored exactly, and with that and the chunks taken
  # layer by layer (no chunk streams the prefix: ~1.1 TB of H2D less over the prompt)
  run 570 $py bench/hip_cli_speed.py --contexts 512K \
    --methods "hip;hip,hip_exact=8;hip,hip_exact=8,prefill_order=layer" \
    --new-tokens 8 --timeout 175 --warmup-tokens 0 --name hip_cli_speed_512k_exact_by_layer
  ;;
143)
  # (~9 min, GGUF) 142 for `fast` and lossless: fast + exact 32 by layer, fast by layer, and
  # lossless `auto` by layer (3,692 tok/s chunk by chunk: hip_cli_speed_512k.json)
  run 570 $py bench/hip_cli_speed.py --contexts 512K \
    --methods "hip,hip_preset=fast,hip_exact=32,prefill_order=layer;hip,hip_preset=fast,prefill_order=layer;auto,prefill_order=layer" \
    --new-tokens 8 --timeout 180 --warmup-tokens 0 --name hip_cli_speed_512k_fast_by_layer
  ;;
139)
  # (~8 min, GGUF) 138 for `fast` (chunks 256/32/8, budgets 32K/8K/2K): its chunks took 0.95 s
  # at the start of 512K and 1.48 s at its end (hip_cli_speed_512k_prefill_steps.json), where
  # streaming the slice's KV alone takes ~1.26 s; --hip-exact 32 scores stages 1 and 2 exactly
  run 500 $py bench/hip_cli_speed.py --contexts 512K --methods "hip,hip_preset=fast;hip,hip_preset=fast,hip_exact=8;hip,hip_preset=fast,hip_exact=32" \
    --new-tokens 8 --timeout 150 --warmup-tokens 0 --name hip_cli_speed_512k_fast_exact
  ;;
134)
  # (~7 min, no GGUF; best on an H200, whose earlier starts attended a third slower on the CPU)
  # issue 23's defaults since 2026-12-07 against the host's wait and a copy, int4 at 512K with
  # the planner's own plan (two rounds, interleaved), then lossless auto at 512K with the defaults
  for i in 1 2; do
    for hr in auto:auto host:copy; do
      h=${hr%:*} r=${hr#*:}
      run 90 $py bench/tiered_store.py --contexts 512K --policies auto+int4 --cpu-attention auto \
        --full-prefill-max 1 --decode-steps 12 --trace-cpu --gpu-memory 24GiB --cpu-handoff $h \
        --cpu-results $r --watchdog 85 --name "int4_512k_auto_${h}_${r}_12steps_$i"
    done
  done
  run 150 $py bench/tiered_store.py --contexts 512K --policies auto --cpu-attention auto --full-prefill-max 1 \
    --gpu-memory 24GiB --decode-steps 4 --cpu-handoff auto --cpu-results auto --watchdog 140 \
    --name cpu_attention_512k_defaults
  ;;
133)
  # (~5 min, GGUF: the two-call setup first) the forty-seventh session's NEXT: the embedded
  # smoke's generate part with its new row (kv=head cpu-attention=8: the CLI's --cpu-attention
  # on CUDA with the stream's wait and mapped results, the defaults since 2026-12-07), then the
  # CUDA checks with those defaults (no KVTIER_CPU_* set)
  # under 260 s: the part took 198 s at b215fec, and it has a row more since
  run 260 $py bench/gpu_smoke.py --models embedded --sections generate --jobs 4 --out "$OUT/gpu_smoke_generate_embedded.json"
  run 110 $py bench/gpu_checks.py
  ;;
132)
  # (~7 min, GGUF: call B right after 131, which carries its first half) the embedded smoke
  # (GPU-facing code changed since it last ran: host-tier reads of coalesced runs), then one
  # int4 512K step under cProfile and the profiler: where the host's ~4.5 ms a layer of issuing
  # goes (129's host was busy all step)
  run 220 $py bench/gpu_smoke.py --models embedded --sections generate --jobs 4 --out "$OUT/gpu_smoke_generate_embedded.json"
  run 150 $py bench/gpu_smoke.py --models embedded --sections plan,eval,serve --out "$OUT/gpu_smoke_serve_embedded.json"
  run 90 $py bench/tiered_store.py --contexts 512K --policies auto+int4 --cpu-attention 32 --head-group 2 \
    --full-prefill-max 1 --decode-steps 3 --profile-step --gpu-memory 24GiB --cpu-handoff gpu \
    --watchdog 80 --name int4_512k_g2_cpu32_gpu_profile_step
  ;;
130)
  # (~5 min, no GGUF; right after 129) lossless bf16 auto at 512K with the host's wait and the
  # stream's (the README's 0.624 s ran with the host's, on an H200 start)
  RUN_TAIL=60
  lossless_handoff_pair 140
  ;;
125)
  # (~3 min, no GGUF) issue 23: int4 at 512K, the library's default loads (--unpack-planned),
  # one, two and four KV heads a slice on one start, each with auto's CPU count and its
  # --trace-cpu timeline: which slicing the planner should take (its simulation, with the
  # measured handoff or without, moves between one and two: cpu_attention.md "Not done")
  for g in 1 2 4; do
    run 100 $py bench/tiered_store.py --contexts 512K --policies auto+int4 --cpu-attention auto --head-group $g \
      --unpack-planned --full-prefill-max 1 --gpu-memory 24GiB --decode-steps 5 --trace-cpu \
      --name "int4_512k_planned_g${g}_timeline"
  done
  ;;
119)
  # (~5 min, right after 118 on the same start) the default refresh with StepProbe's columns
  run 300 $py bench/hip_cli_speed.py --contexts 1M --methods hip,kv_quant=int4,hip_probes=on \
    --new-tokens 161 --timeout 290 --warmup-tokens 0 --name hip_cli_speed_1m_int4_probes_graphs_161_probe
  ;;
110)
  # (~9 min, GGUF) issue 19 through the CLI at 512K with graphs (now the default): stage 0 on
  # probes beside the default's host keys, one start (86 with graphs); the declined counts
  run 280 $py bench/hip_cli_speed.py --contexts 512K --methods "hip,hip_probes=on" --new-tokens 64 \
    --timeout 270 --warmup-tokens 0 --name hip_cli_speed_512k_graphs_probes
  run 260 $py bench/hip_cli_speed.py --contexts 512K --methods "hip" --new-tokens 64 \
    --timeout 250 --warmup-tokens 0 --name hip_cli_speed_512k_graphs_default
  ;;
111)
  # (~6 min, GGUF) issue 19's 1M decode in steady state: 161 new tokens hold 5 of lean's stage-0
  # reruns in their 160 timed steps (the 64-token run held 1 in 63: 19.03 tok/s flatters a long
  # answer), with every step's time (decode_step_times_s) and the graphs' declines by why
  run 570 $py bench/hip_cli_speed.py --contexts 1M --methods hip,kv_quant=int4,hip_probes=on \
    --new-tokens 161 --timeout 560 --warmup-tokens 0 --name hip_cli_speed_1m_int4_probes_graphs_161
  ;;
112)
  # (~6 min, no GGUF) 103's kernel A/B again: hip_kernels.py's prune() had timed the max head
  # score in every row (the preset's softmax one was never passed), so the fused logsumexp, the
  # two-pass and torch head scores and what the per-row maxima cost were never compared
  lean_kernels hip_kernels_smollm2_16k_lean_softmax _b
  ;;
106)
  # (~4 min, GGUF: the prose prompt's tokenizer) issue 19 through the CLI, the fortieth
  # session's decode graphs (KVTIER_HIP_GRAPHS=1; bench/results/hip_decode_profile_lean_512k_
  # int4_probes_g4_layer_graphs.json: cached steps 2.38 -> 1.22 ms of 4 layers) at 128K with
  # probe scoring, off and on alternating on one machine start (runs vary ~2x between starts)
  for i in 1 2; do
    for g in 0 1; do
      KVTIER_HIP_GRAPHS=$g run 100 $py bench/hip_cli_speed.py --contexts 128K --methods "hip,hip_probes=on" \
        --new-tokens 64 --timeout 90 --warmup-tokens 0 --name "hip_cli_speed_128k_graphs_${g}_run$i"
    done
  done
  ;;
107)
  # (~7 min, GGUF) 106 at 512K, one run each (graphs on first: the second run has Triton's cache)
  for g in 1 0; do
    KVTIER_HIP_GRAPHS=$g run 280 $py bench/hip_cli_speed.py --contexts 512K --methods "hip,hip_probes=on" \
      --new-tokens 64 --timeout 270 --warmup-tokens 0 --name "hip_cli_speed_512k_graphs_$g"
  done
  ;;
105)
  # (~9 min, on the machine 98 left the GGUF on) 99 with each layer's cached decode steps replayed
  # as one CUDA graph (KVTIER_HIP_GRAPHS=1; 99's row is the same command without it)
  KVTIER_HIP_GRAPHS=1 run 570 $py bench/hip_cli_speed.py --contexts 1M --methods hip,kv_quant=int4,hip_probes=on \
    --new-tokens 64 --timeout 560 --warmup-tokens 0 --name hip_cli_speed_1m_int4_probes_graphs
  ;;
103)
  # (~8 min, no GGUF) issue 19's prefill after the bisection kernel writes each row's logsumexp
  # in parts (the softmax head score reads the per-row maxima once, not twice; _row_lse took
  # 0.13 s of lean's 2.12 s chunk at 48K on Llama-3's shapes and 32 ms of SmolLM2's 0.36 s 16K
  # prefill): the kernels' A/B (hip_kernels' "two-pass head score" row), SmolLM2's 16K prefill,
  # and the 48K chunk profiled as hip_offload_prefill_48k_lean_fast.json was. Then group 98 (the
  # smoke: GPU-facing code changed).
  lean_kernels hip_kernels_smollm2_16k_lean_fused ""
  run 90 $py bench/hip_small_prefill.py --model smollm2-135m --lengths 16K --repeats 2 --new-tokens 8 \
    --methods "auto;hip" --profile --name hip_small_prefill_fused_lse
  run 100 $py bench/hip_offload.py --contexts 48K --presets lean --policy planned --no-dense --steps 0 \
    --prefill-chunk 16384 --profile --name hip_offload_prefill_48k_lean_fused
  ;;
102)
  # (~1 min, no GGUF) the thirty-eighth session's decode finding: lean's refresh steps are bound
  # by host work, a dozen Triton launches a slice at ~60 us each under cProfile. Their plain host
  # cost through Triton's dispatch and straight to the compiled kernel, beside a torch operator's
  # (if the gap is large, a launch cache for the decode kernels is the cheap half of the fix)
  run 60 $py bench/launch_overhead.py --name launch_overhead
  ;;
97)
  # (~2 min) the thirty-eighth session's call A (carry .gguf_a and .whl, copy the half first):
  # issue 19's SmolLM2 prefill at 16K after the pruning's batches (a stage's queries rotated once
  # for all batches; the head score reads the lengths; a resident plan with room prunes a whole
  # chunk in one batch a stage: 59-63 operators a layer where 287-294 ran, bench/prefill_prune_ops.py,
  # stubbed) and 2 warps for its 64-row tiles. At 830eb89 lean made 36,733 tok/s (0.124x dense,
  # hip_small_prefill_head_score.json), bound by launches. Random weights. No GGUF.
  run 110 $py bench/hip_small_prefill.py --model smollm2-135m --lengths 16K --repeats 2 --new-tokens 8 \
    --methods "auto;hip" --profile --name hip_small_prefill_whole_chunk
  ;;
98)
  # (~8 min) call B, at once after 97 (carry .gguf_b and .whl): the embedded smoke (GPU-facing
  # code changed: the pruning's batches and warps, the plan's pruning bytes; since e552b94 the
  # fused logsumexp and the layer-batched stage reruns, which its "lossy hip probes head" row runs)
  run 220 $py bench/gpu_smoke.py --models embedded --sections generate --jobs 4 --out "$OUT/gpu_smoke_generate_embedded.json"
  run 250 $py bench/gpu_smoke.py --models embedded --sections plan,eval,serve --out "$OUT/gpu_smoke_serve_embedded.json"
  ;;
99)
  # (~9 min, on the machine 98 left the GGUF on: the prose prompt needs its tokenizer) issue 19's
  # 1M decode through the CLI with int4 and probe scoring, which failed to compile at 830eb89
  # (fixed in d5f16d9; tests/test_triton_compile.py compiles the kernels' variants on the CPU).
  # The row took 251 s to reach its first decode step there.
  run 570 $py bench/hip_cli_speed.py --contexts 1M --methods hip,kv_quant=int4,hip_probes=on --new-tokens 64 \
    --timeout 560 --warmup-tokens 0 --name hip_cli_speed_1m_int4_probes_c
  ;;
101)
  # (~7 min, GGUF) issue 19: lean with its last stage's queries pooled in pairs (--hip-strides
  # 4/4/2 halves what the bisection scores, which bounds SmolLM2's 16K prefill once the launches
  # are cut): its speed beside lean's on one start, then its NIAH grids beside the default's
  # (prose 16K 30/33, 32K 29/33: niah_smollm2_cuda_prose_hip_auto_x3.json)
  run 110 $py bench/hip_small_prefill.py --model smollm2-135m --lengths 16K --repeats 2 --new-tokens 8 \
    --methods "auto;hip;hip,hip_strides=4/4/2" --name hip_small_prefill_strides
  niah_cuda prose hip,hip_strides=4/4/2 niah_smollm2_cuda_prose_hip_strides_x3
  niah_cuda repeat hip,hip_strides=4/4/2 niah_smollm2_cuda_repeat_hip_strides_x3
  ;;
100)
  # (~6 min, on a machine with the GGUF: the prose prompt needs its tokenizer) issue 19's 512K
  # prefill through the CLI (1.28-1.41x lossless; the bench's last 15K chunk alone ran 5,789
  # tok/s under lean and 11,844 under fast, hip_offload_prefill_512k_lean_fast_b.json, while the
  # CLI's whole prompt averaged ~4,700): each prefill step is now timed (stats.prefill_step_s),
  # so the rows show whether the chunks ramp with the context as the bench predicts or cost
  # more throughout.
  run 340 $py bench/hip_cli_speed.py --contexts 512K --methods "hip;hip,hip_preset=fast" --new-tokens 8 \
    --timeout 160 --warmup-tokens 0 --name hip_cli_speed_512k_prefill_steps
  ;;
96)
  # (~5 min, no GGUF) 94's 512K rows alone (--steps 0: prefill rows only): a 15K-token chunk at
  # the end of 512K under lean and fast, profiled (issue 19's 512K prefill, 1.28-1.41x lossless
  # through the CLI where the bench's last chunk under fast made 6.6x).
  run 320 $py bench/hip_offload.py --contexts 512K --presets lean,fast --policy planned --no-dense --steps 0 \
    --prefill-chunk 15360 --profile --name hip_offload_prefill_512k_lean_fast_b
  ;;
95)
  # (~4 min, no GGUF) issue 19: SmolLM2's HiP prefill at 16K after the softmax head score moved
  # into two Triton passes, the bisection's rows lost their -inf fill and its 192 rows a KV
  # head run as 3 tiles of 64 instead of 256 with 64 masked, and pruning batches of 45 blocks
  # where ~27 ran (fewer launches; 12 at 512K where 8 ran) (lean 24,780 tok/s =
  # 0.073x dense on an H100 before, hip_small_prefill_profile_b.json; the head score's torch
  # passes were ~200 ms of its 0.68 s profiled prefill). Random weights.
  run 170 $py bench/hip_small_prefill.py --model smollm2-135m --lengths 16K --repeats 2 --new-tokens 8 \
    --methods "auto;hip" --profile --name hip_small_prefill_head_score
  # the kernels alone at those shapes: the bisection before the row tiles (23f5b5e's file) beside
  # this one, and the head score's torch passes beside its Triton ones
  git show 23f5b5e:kvtier/sparse/triton_bisect.py > /tmp/old_bisect.py
  run 200 $py bench/hip_kernels.py --model smollm2-135m --preset lean --context 0 --chunk 16384 --heads 3 \
    --old-bisect /tmp/old_bisect.py --name hip_kernels_smollm2_16k_lean
  ;;
94)
  # (~7 min) the thirty-sixth session's first call (call A, with the GGUF's first half): issue
  # 19's two prefill gaps profiled. SmolLM2's HiP prefill at 16K (0.11-0.13x dense, target 0.5x;
  # random weights), then one 15K-token prefill chunk at the end of 512K under `lean` (what auto
  # runs past the trained length) and `fast`, each profiled: lean's prefill halved fast's at
  # 160K through the CLI, and the CLI's whole-prompt 4,731 tok/s is under the bench's last-chunk
  # 12.8K (fast). No GGUF.
  run 150 $py bench/hip_small_prefill.py --model smollm2-135m --lengths 16K --repeats 2 --new-tokens 8 \
    --methods "auto;hip;hip,hip_preset=long" --profile --name hip_small_prefill_profile_b
  run 260 $py bench/hip_offload.py --contexts 512K --presets lean,fast --policy planned --no-dense --steps 2 \
    --prefill-chunk 15360 --profile --name hip_offload_prefill_512k_lean_fast
  ;;
93)
  # (~4 min) the thirty-fifth session's first call: the native kernel's rates over packed rows
  # (the next row prefetched while a row's heads attend: 1 thread 2.08 -> 2.76 M tokens/s on the
  # CPU machine; 22.5 GB/s at 15 threads on the H200's host before), then 84's CPU-slice pair
  # (issue 23's 0.25 s/token; does the unpack stream win beside CPU slices? the planner's model
  # says no: 0.261 against 0.264), then SmolLM2's HiP prefill profiled. No GGUF (call A of the
  # GGUF's two carries its first half).
  run 100 $py bench/cpu_attention_rows.py --threads 1,8,15 --bits 4,8 --reps 3 --name cpu_attention_rows_h200_prefetch
  for a in "" "--unpack-stream"; do
    run 100 $py bench/tiered_store.py --contexts 512K --policies auto+int4 --cpu-attention auto --head-group 1 \
      --full-prefill-max 1 --gpu-memory 24GiB --decode-steps 4 $a --name "int4_512k_g1_cpu_ab${a:+_unpack}"
  done
  # issue 19's SmolLM2 prefill (HiP 0.11-0.13x dense at 16K, target 0.5x): where its time goes
  # now (the last profile, hip_small_prefill_profile.json, is from 5170bf8). Random weights.
  run 150 $py bench/hip_small_prefill.py --model smollm2-135m --lengths 16K --repeats 2 --new-tokens 8 \
    --methods "auto;hip;hip,hip_preset=long" --profile --name hip_small_prefill_profile_b
  ;;
94)
  # call B after 93: the embedded smoke (89; GPU-facing since 1c3d349: the planned unpack stream),
  # then 87 (probe scoring's NIAH on CUDA). GGUF.
  bash "$0" 89
  bash "$0" 87
  ;;
85)
  # issue 19: decode's stage 0 on the bisection's probes alone (HipConfig.probe_scoring, built on
  # the CPU in the thirty-third session): 8 layers of Llama-3's shapes at 512K, `lean`, 8-head
  # slices, covering caches, host keys without and with probes, read in place from pinned host
  # memory (CPU counts at 1 layer: 898 -> 220 operators a slice in a stage-0 rerun, its keys
  # 2.14 GB -> 0.13 GB in fp32; at b0c523e a stage-0 step of 8 slices took 1.01 s, the 17.35
  # tok/s CLI run's max step 1.13 s); then the kernel's CUDA tests. No GGUF.
  for a in "" "--probe-scoring"; do
    run 200 $py bench/hip_decode_profile.py --as-preset --preset lean --context 512K --layers 8 \
      --kv-heads 8 --group 8 --head-dim 128 --steps 34 --kv-fill structured --host-scoring $a \
      --name "hip_decode_profile_lean_512k_probe_ab${a:+_probes}"
  done
  run 240 $py -m pytest -q -p no:cacheprovider tests/test_probe_scoring.py tests/test_triton_bisect.py
  ;;
86)
  # issue 19 through the CLI: 512K with --hip-probes on (host keys are on there by default:
  # stage 0 read in place by probe) beside the default on the same start (17.35 tok/s at
  # b0c523e, 13.26 at 182bb02 on other starts; a stage-0 step ~1.1 s of its 64). GGUF (the
  # tokenizer).
  run 280 $py bench/hip_cli_speed.py --contexts 512K --methods "hip,hip_probes=on" --new-tokens 64 \
    --timeout 240 --warmup-context 16K --name hip_cli_speed_512k_hip_probes
  run 260 $py bench/hip_cli_speed.py --contexts 512K --methods "hip" --new-tokens 64 \
    --timeout 240 --warmup-tokens 0 --name hip_cli_speed_512k_hip_probes_base
  ;;
87)
  # issue 19: probe scoring's quality (its scores sum in another order than the torch decode
  # path's): the CUDA NIAH grids the default passed (prose 16K 30/33, 32K 29/33:
  # niah_smollm2_cuda_prose_hip_auto_x3.json; repeat: niah_smollm2_cuda_32k_repeat_lean_x3.json).
  # GGUF.
  niah_cuda prose hip,hip_probes=on niah_smollm2_cuda_prose_hip_probes_x3
  niah_cuda repeat hip,hip_probes=on niah_smollm2_cuda_repeat_hip_probes_x3
  ;;
92)
  # issue 19's 1M target (20 tok/s) through the CLI: int4 with --hip-probes on, so auto takes host
  # keys (stage 0 reads its probes' codes in place) and the plan covering block caches (6.53 GB of
  # HiP memory, `kvtier plan --context 1M ... --kv-quant int4 --hip-probes on`), steps that rerun
  # nothing a layer at once. Prefill of ~1M tokens first (~4-5 min). GGUF (the tokenizer).
  run 580 $py bench/hip_cli_speed.py --contexts 1M --methods "hip,kv_quant=int4,hip_probes=on" --new-tokens 64 \
    --timeout 560 --warmup-tokens 0 --name hip_cli_speed_1m_int4_probes
  ;;
91)
  # 90 cut to a short budget's first call: the CUDA tests and issue 23's traced A/B (then, with
  # the GGUF's second half, 89's generate part).
  run 150 $py -m pytest -q -p no:cacheprovider tests/test_triton_attn.py -k cuda
  for a in "" "--unpack-stream"; do
    run 100 $py bench/tiered_store.py --contexts 512K --policies auto+int4 --cpu-attention off --head-group 1 \
      --full-prefill-max 1 --gpu-memory 24GiB --decode-steps 3 --trace-step $a --name "int4_512k_g1_trace_ab${a:+_unpack}"
  done
  ;;
90)
  # what one call of a short device budget must do first: 91 (the new decode kernel's CUDA tests,
  # issue 23's traced --unpack-stream A/B), then the layer path's A/B (88, 16 layers). No GGUF
  # (call A of the GGUF's two carries its first half along).
  bash "$0" 91
  layer_ab 16 90
  ;;
88)
  # issue 19: decode steps that rerun nothing, a layer's slices at once (the thirty-fourth
  # session: HipKernel.attend_cached_layer, one RoPE, one row write, one attention and one merge
  # launch a layer; CPU operators a slice 17.2 -> 11.6) against a slice at a time, on one start,
  # 2-head slices (4 a layer, 1M's 128-slice shape) at 128K with host keys; first the new
  # kernel's CUDA tests (batched = alone, bitwise). No GGUF.
  run 150 $py -m pytest -q -p no:cacheprovider tests/test_triton_attn.py
  layer_ab 32 110
  ;;
89)
  # the smoke of the embedded model alone (GPU-facing code changed: HiP decode's buffers attend
  # through attend_buffers_triton, a layer at once): generate, then plan, eval and serve. GGUF.
  run 220 $py bench/gpu_smoke.py --models embedded --sections generate --jobs 4 --out "$OUT/gpu_smoke_generate_embedded.json"
  run 250 $py bench/gpu_smoke.py --models embedded --sections plan,eval,serve --out "$OUT/gpu_smoke_serve_embedded.json"
  ;;
77)
  # issue 18: requests naming a method, each alone, on the 24 GiB server (Llama-3.1-8B shapes):
  # HiP at 304 tokens failed there at 182bb02; HiP's decode memory is now bounded by the request
  # and a request that fits nowhere else borrows the pages the batch's keep withheld (HiP 16K,
  # 128K and 256K should borrow ~635-659 pages, 256K with a 4K-token stopgap cache:
  # serve_lend_plans_24gib_kept.json). No GGUF.
  run 260 $py bench/serve_methods_fit.py --gpu-memory 24GiB --name serve_methods_fit_24gib
  ;;
78)
  # issue 18, the H100's mixed HiP rows on an H200 (the thirty-first session): 72's case with
  # --offload-reserve 4GiB (four-head slices: 0.427 s/token on the H100) and with the default
  # reserve (one-head slices, a 4K stopgap cache: 1.005), each with c32 (the shorts alone, issue
  # 18's 2x baseline, not run on the H100). Needs .whl (uvicorn). No GGUF.
  run 280 $py bench/serve_gpu.py --gpu-memory 24GiB --cases c32,mixed --long-method hip --offload-reserve 4GiB \
    --mixed-timeout 230 --name serve_gpu_24gib_mixed_hip_reserve4
  run 280 $py bench/serve_gpu.py --gpu-memory 24GiB --cases c32,mixed --long-method hip \
    --mixed-timeout 230 --name serve_gpu_24gib_mixed_hip
  ;;
70)
  # 512K through the CLI with the default `--hip-host-keys auto` (on from 256K), the JSON now
  # records the machine start's pinned H2D and host-read rates: 17.35 and 8.89 tok/s on two
  # starts with the same code. Needs the GGUF (the 8B folder takes its tokenizer).
  run 290 $py bench/hip_cli_speed.py --contexts 512K --methods "hip" --new-tokens 64 \
    --timeout 280 --warmup-tokens 0 --name hip_cli_speed_512k_hip_auto_keys
  ;;
2)
  run 200 $py bench/serve_gpu.py --cases c1,c16,c64,c1-32k --name serve_gpu
  run 100 $py bench/serve_profile.py --batches 1,64 --context 1024
  run 100 $py bench/serve_profile.py --batches 1,64 --context 1024 --no-fuse --name serve_profile_unfused
  ;;
3)
  run 330 $py bench/serve_gpu.py --gpu-memory 24GiB --cases c32,mixed,prefix --name serve_gpu_24gib
  run 200 $py bench/hf_cache.py --contexts 32K,128K --gpu-memory 24GiB --kv auto
  ;;
4)
  run 120 $py bench/cpu_attention.py --threads 1,8,15 --combined --name cpu_attention_h200
  run 200 $py -m kvtier generate --model /tmp/kvtier-smoke/llama-3.1-8b-random --prompt-file /tmp/kvtier-smoke/long.txt \
    --gpu-memory 24GiB --cpu-attention auto --max-new-tokens 8 --json > "$OUT/cpu_attention_generate.json"
  run 120 $py bench/tiered_store.py --model gemma-2-9b --contexts 128K --policies auto \
    --full-prefill-max 0 --gpu-memory 24GiB --name gemma2_9b_offload
  run 90 $py bench/hip_recall.py --device cuda --model llama-3-8b --layers 0 --tokens 512K \
    --name hip_recall_llama8b_512k
  ;;
5)
  run 40 $py bench/copy_contention.py
  run 230 $py bench/serve_gpu.py --gpu-memory 24GiB --cases c32,mixed,prefix --name serve_gpu_24gib
  run 130 $py bench/serve_gpu.py --cases c1,c16,c64,c1-32k --name serve_gpu
  run 80 $py bench/serve_profile.py --batches 64 --context 1024
  ;;
6)
  run 200 $py bench/serve_gpu.py --gpu-memory 24GiB --cases c32,mixed,prefix --name serve_gpu_24gib
  run 100 $py bench/hf_cache.py --contexts 128K --gpu-memory 24GiB --kv auto --name hf_cache_128k
  run 50 $py bench/gpu_checks.py
  run 60 $py bench/cpu_attention.py --threads 1,8,15 --combined --name cpu_attention_h200
  ;;
7)
  run 250 $py bench/tiered_store.py --contexts 128K,512K --policies auto --cpu-attention off,auto \
    --full-prefill-max 1 --gpu-memory 24GiB --decode-steps 6 --name cpu_attention_decode
  run 220 $py bench/serve_gpu.py --gpu-memory 24GiB --cases c32,mixed,prefix --name serve_gpu_24gib
  ;;
8)
  run 230 $py bench/hf_cache.py --contexts 128K --gpu-memory 24GiB --kv auto --name hf_cache_128k
  CUDA_DEVICE_MAX_CONNECTIONS=32 run 160 $py bench/serve_gpu.py --gpu-memory 24GiB --cases c32,mixed \
    --name serve_gpu_24gib_conn32
  ;;
9)
  run 220 $py bench/serve_gpu.py --gpu-memory 24GiB --cases c32,mixed,prefix --name serve_gpu_24gib
  run 150 $py bench/serve_gpu.py --gpu-memory 24GiB --cases c32,mixed --tiered-lookahead-layers 0 \
    --name serve_gpu_24gib_unpaced
  run 100 $py bench/tiered_store.py --contexts 128K --policies auto --cpu-attention 4,10,17 \
    --full-prefill-max 1 --gpu-memory 24GiB --decode-steps 6 --name cpu_attention_sweep_128k
  ;;
10)
  run 140 $py bench/tiered_store.py --contexts 512K --policies auto --cpu-attention 20,44,58 \
    --full-prefill-max 1 --gpu-memory 24GiB --decode-steps 4 --name cpu_attention_sweep_512k
  run 280 $py bench/tiered_store.py --model gemma-2-9b --contexts 640K --policies auto \
    --full-prefill-max 1 --gpu-memory 24GiB --decode-steps 3 --name gemma2_9b_offload_max
  ;;
11)
  run 220 $py bench/tiered_store.py --model deepseek-v2-lite --contexts 128K,1M,2M --policies auto \
    --full-prefill-max 1 --gpu-memory 24GiB --decode-steps 3 --name deepseek_v2_lite_offload
  ;;
12)
  run 250 $py bench/gpu_smoke.py --sections plan,eval,serve --out "$OUT/gpu_smoke_serve.json"
  run 160 $py bench/tiered_store.py --model deepseek-v2-lite --contexts 128K,1M,2M --policies auto \
    --full-prefill-max 1 --gpu-memory 24GiB --decode-steps 3 --name deepseek_v2_lite_offload
  run 180 $py bench/tiered_store.py --contexts 128K,512K --policies auto --cpu-attention auto \
    --full-prefill-max 1 --gpu-memory 24GiB --decode-steps 4 --name cpu_attention_decode_3buf
  ;;
14)
  # issue 23: the split simulation predicts finer slices meet 0.65 s at 512K (1 KV head a slice
  # 0.634, 2 heads 0.643, the planner's 4 heads 0.671); auto picks the group without the CPU
  run 200 $py bench/tiered_store.py --contexts 512K --policies auto --cpu-attention auto --head-group 1 \
    --full-prefill-max 1 --gpu-memory 24GiB --decode-steps 4 --name cpu_attention_512k_g1
  run 160 $py bench/tiered_store.py --contexts 512K --policies auto --cpu-attention auto --head-group 2 \
    --full-prefill-max 1 --gpu-memory 24GiB --decode-steps 4 --name cpu_attention_512k_g2
  ;;
15)
  # the ninth session's first call: group 14, then issue 21's DeepSeek-V2-Lite at its longest
  # contexts under 24 GiB (the plan says ~2.8M fit 100 GiB of host; 1M is measured)
  run 200 $py bench/tiered_store.py --contexts 512K --policies auto --cpu-attention auto --head-group 1 \
    --full-prefill-max 1 --gpu-memory 24GiB --decode-steps 4 --name cpu_attention_512k_g1
  run 160 $py bench/tiered_store.py --contexts 512K --policies auto --cpu-attention auto --head-group 2 \
    --full-prefill-max 1 --gpu-memory 24GiB --decode-steps 4 --name cpu_attention_512k_g2
  run 200 $py bench/tiered_store.py --model deepseek-v2-lite --contexts 2M,2560K --policies auto \
    --full-prefill-max 1 --gpu-memory 24GiB --decode-steps 3 --chunk-size 1024 --name deepseek_v2_lite_offload_max
  ;;
16)
  # the ninth session, after the GGUF: one store (page-major pool, tiered runs over lent pages,
  # host slots of every layer): the server's user paths, then the whole-GPU cases
  run 250 $py bench/gpu_smoke.py --sections plan,eval,serve --out "$OUT/gpu_smoke_serve.json"
  run 150 $py bench/serve_gpu.py --cases c1,c1-32k,c64 --name serve_gpu
  ;;
17)
  # under 24 GiB: the mixed case with the long request's buffers in lent pool pages (the default
  # share, 0.25) and without (0: the offload reserve only, as before), and the prefix case
  run 240 $py bench/serve_gpu.py --gpu-memory 24GiB --cases c32,mixed,prefix --name serve_gpu_24gib
  run 170 $py bench/serve_gpu.py --gpu-memory 24GiB --cases mixed --tiered-share 0 --name serve_gpu_24gib_share0
  ;;
18)
  # Ran in the eleventh session at 48c4e3a (results_h200.md). Ran at 59b2cd1 in the tenth: no pages were borrowed even with
  # --tiered-keep-tokens 0 (a planning bug, fixed in c91709f), and the three mixed runs missed
  # (shorts 2.12-2.72x, long 1.24-1.28x). The shorts' first five batch steps (their prefill
  # chunks) take 1.6-3.4 s; trace them, with lending now working, and time the kernel's splits
  # with graph replays (the first run timed host launches)
  run 150 $py bench/serve_gpu.py --gpu-memory 24GiB --cases c32,mixed --tiered-keep-tokens 0 \
    --mixed-profile-steps 0,6 --trace --name serve_gpu_24gib_lent_c
  run 125 $py bench/serve_gpu.py --gpu-memory 24GiB --cases mixed --mixed-profile-steps 0,6 --trace \
    --name serve_gpu_24gib_trace
  run 60 $py bench/paged_decode_splits.py --iters 30
  run 125 $py bench/serve_gpu.py --gpu-memory 24GiB --cases mixed --tiered-keep-tokens 0 \
    --tiered-release-after-prefill --name serve_gpu_24gib_lent_release
  ;;
21)
  # NEXT (the twelfth session): did deferring decode write-backs (ce60905) remove the D2H waits?
  # Trace the shorts' first steps again, and the batch's activations in a pool of their own (no
  # cudaMalloc while a run is queued). Then group 22 (GPU-facing code changed since c08d583).
  run 150 $py bench/serve_gpu.py --gpu-memory 24GiB --cases c32,mixed --mixed-profile-steps 1,7 --trace \
    --name serve_gpu_24gib_trace_c
  run 140 $py bench/serve_gpu.py --gpu-memory 24GiB --cases mixed --name serve_gpu_24gib_deferred_b
  run 140 $py bench/serve_gpu.py --gpu-memory 24GiB --cases mixed --activation-pool --name serve_gpu_24gib_pool
  ;;
23)
  # the whole-GPU cases after default_splits rounds down (one stream gets 33 splits, 32+ get one):
  # c1-32k's target is 8 ms/token (8.05-8.30 with 16 splits); the kernel alone again
  run 170 $py bench/serve_gpu.py --cases c1,c1-32k,c32,c64 --name serve_gpu
  run 60 $py bench/paged_decode_splits.py --iters 30
  ;;
24)
  # issue 23's int4 host KV with CPU attention: the packed kernel's rates on the H200's host, the
  # GPU checks (int4 rows), and 512K decode with int4 alone and with CPU slices (target 0.25 s)
  run 90 $py bench/cpu_attention_rows.py --threads 1,8,15 --name cpu_attention_rows_h200
  run 60 $py bench/gpu_checks.py
  run 300 $py bench/tiered_store.py --contexts 512K --policies auto+int4 --cpu-attention off,20,40 \
    --full-prefill-max 1 --gpu-memory 24GiB --decode-steps 4 --name cpu_attention_int4_512k
  ;;
25)
  # the twelfth session's first call (carry .gguf_a too): one stream at 1K and 32K with the
  # rounded-down split counts (c1-32k's target is 8 ms/token); the 24 GiB mixed case with the
  # batch's activations in a pool of their own and without, each beside c32 in one process
  run 110 $py bench/serve_gpu.py --cases c1,c1-32k --name serve_gpu_splits
  run 160 $py bench/serve_gpu.py --gpu-memory 24GiB --cases c32,mixed --activation-pool --name serve_gpu_24gib_pool
  run 160 $py bench/serve_gpu.py --gpu-memory 24GiB --cases c32,mixed --name serve_gpu_24gib_deferred_b
  ;;
27)
  # issue 23's int4 host KV with CPU attention (group 24 in the order that keeps the quick rows if
  # the long one runs out of time): the packed kernel's rates on the H200's host, the GPU checks,
  # then 512K decode with int4 alone and with CPU slices (target 0.25 s)
  run 80 $py bench/cpu_attention_rows.py --threads 1,8,15 --name cpu_attention_rows_h200
  run 60 $py bench/gpu_checks.py
  run 300 $py bench/tiered_store.py --contexts 512K --policies auto+int4 --cpu-attention off,20,40 \
    --full-prefill-max 1 --gpu-memory 24GiB --decode-steps 4 --name cpu_attention_int4_512k
  ;;
28)
  # the twelfth session's last call: where the shorts' time goes beside the long request. The
  # 1a4fb9b run's shorts spanned 3.67 s while their batch steps summed to ~2.8 s: time outside
  # engine.step() (the loop's other work, or the GIL while the launcher thread queues the long
  # token). The mixed case no longer profiles by default (it slowed the steps it recorded).
  run 170 $py bench/serve_gpu.py --gpu-memory 24GiB --cases c32,mixed --name serve_gpu_24gib_gaps
  run 170 $py bench/serve_gpu.py --gpu-memory 24GiB --cases c32,mixed --switch-interval 0.0005 \
    --name serve_gpu_24gib_switch
  run 150 $py bench/serve_gpu.py --gpu-memory 24GiB --cases mixed --mixed-profile-steps 0,8 --trace \
    --name serve_gpu_24gib_trace_d
  ;;
29)
  # NEXT (the thirteenth session). Each c* case now records the batch stream's idle time between
  # steps (device_idle_ms_p50: host-bound time; c1 is at 6.03 ms/token against issue 18's 6, and
  # launching the next decode step before reading this one's token back would hide it) and the
  # interpreter's garbage collections. Then: what a served model's tokenizer costs the batch, now that a
  # step decodes each sequence's text incrementally (7d7d65f; before, the whole output every
  # step: 45 ms a step for 64 sequences at 2K tokens on the dev CPU, bench/detokenize.py); the
  # random-weight preset has no tokenizer, so earlier serve runs never paid it. Carry .tok (the
  # embedded model's tokenizer files: mkdir .tok; cp .cache/gguf/*/tokenizer*.json .tok/)
  run 200 $py bench/serve_gpu.py --cases c1,c64,c64-1k-out --tokenizer .tok --name serve_gpu_tokenizer
  run 160 $py bench/serve_gpu.py --cases c1,c64,c64-1k-out --name serve_gpu_no_tokenizer
  run 60 $py bench/detokenize.py --tokenizer .tok --name detokenize_h200
  # sampled requests (temperature 0.8, top_p 0.95), which real clients send: one batched draw a
  # step since the sampler change (~87 operators for 64 sequences, ~1,000 before)
  run 120 $py bench/serve_gpu.py --cases c64 --temperature 0.8 --top-p 0.95 --name serve_gpu_sampled
  ;;
30)
  # after 29, at once (carry .whl and .tok): two decode forwards a step, the second on the first's
  # tokens sampled on the device (no host gap between them), against 29's runs
  # (device_idle_ms_p50 says what it can hide); then the start-up heap left unfrozen, beside 29's
  # tokenizer run (were its two ~800 ms steps full garbage collections? each case records them)
  run 120 $py bench/serve_gpu.py --cases c1,c1-32k,c64 --decode-steps 2 --name serve_gpu_decode2
  run 120 $py bench/serve_gpu.py --cases c64-1k-out --tokenizer .tok --no-freeze --name serve_gpu_tokenizer_nofreeze
  run 250 $py bench/serve_gpu.py --gpu-memory 24GiB --cases c32,mixed --name serve_gpu_24gib_frozen
  ;;
31)
  # the thirteenth session's first call (carry .whl, .gguf_a and .tok; copy the half to /tmp/gg
  # first): group 29's tokenizer run and group 30's two-forward decode, the two that time this
  # code's host work per step (device_idle_ms_p50 in each case; the gc summary)
  run 200 $py bench/serve_gpu.py --cases c1,c64,c64-1k-out --tokenizer .tok --name serve_gpu_tokenizer_b
  run 100 $py bench/serve_gpu.py --cases c1,c1-32k --decode-steps 2 --name serve_gpu_decode2
  ;;
32)
  # at once after 31 (carry .whl and .gguf_b): issue 19 on CUDA. HiP's softmax head score (preset
  # long) now prunes a prefill chunk's query blocks together (before: block by block, SmolLM2
  # prefilled 480-750 tok/s); then the NIAH grid past the trained length, one command per cell
  # so a slow one costs only itself
  for cell in "16k prose" "16k repeat" "32k prose" "32k repeat"; do
    set -- $cell
    run 100 kvtier eval niah --lengths "$1" --depths 0:100:10 --samples 1 --haystack "$2" --device cuda \
      --max-model-len 33000 --method auto --method hip,hip_preset=long --no-progress \
      --out "$OUT/niah_smollm2_cuda_$1_$2.json"
  done
  ;;
35)
  # with the GGUF's first half (its call has no model): issue 19's SmolLM2 HiP prefill against
  # dense at 4K-32K on the same shapes with random weights (prompt ids random), after the
  # batching fixes (softmax head score; a chunk that begins among the sinks)
  run 200 $py bench/hip_small_prefill.py --model smollm2-135m --lengths 4K,16K,32K --name hip_small_prefill_preset
  ;;
38)
  # issue 19 (no GGUF): where HiP's 16K prefill on SmolLM2 shapes goes (0.046x dense at b2d667c:
  # by count the gather-attention kernel at ~7 TFLOP/s; check it), dense beside it
  run 150 $py bench/hip_small_prefill.py --model smollm2-135m --lengths 16K --repeats 1 \
    --methods "auto;hip,hip_preset=long" --profile --name hip_small_prefill_profile
  # the two kernels alone at those shapes (a 16K prompt's one chunk, 3 KV heads of 3 query
  # heads, head dim 64), attention under several tile choices, with its TFLOP/s
  run 150 $py bench/hip_kernels.py --model smollm2-135m --preset long --context 0 --chunk 16384 \
    --heads 3 --name hip_kernels_smollm2_16k
  ;;
39)
  # with the GGUF's first half (no model): issue 19's SmolLM2-shape HiP prefill after this
  # session's fixes (a chunk's blocks all in one batch, no per-layer host reads, the softmax
  # head score without a strided softmax), profiled; auto is now the batch engine's path
  run 150 $py bench/hip_small_prefill.py --model smollm2-135m --lengths 16K,32K --repeats 1 \
    --methods "auto;hip,hip_preset=long" --profile --name hip_small_prefill_fixes
  ;;
41)
  # no GGUF: why one prompt through the batch engine (auto) prefills at half the tiered store's
  # rate (gpu: the store's resident path) on the same machine; profiles of the prefill alone
  run 200 $py bench/hip_small_prefill.py --model smollm2-135m --lengths 16K,32K --repeats 2 \
    --methods "auto;gpu;hip,hip_preset=long" --profile --name hip_small_prefill_paths
  ;;
40)
  # after 22 (the GGUF in place): issue 19's weakest cell, 32K, at 3 samples a depth, HiP alone
  for hay in ${HAYSTACKS:-prose repeat}; do
    run 130 kvtier eval niah --lengths 32k --depths 0:100:10 --samples 3 --haystack "$hay" --device cuda \
      --max-model-len 33000 --method hip,hip_preset=long --no-progress --out "$OUT/niah_smollm2_cuda_32k_${hay}_x3.json"
  done
  ;;
36)
  # issue 19's quality grid as the issue asks it (needs the GGUF: the two-call setup first):
  # 3 samples per depth on both haystacks; past the trained length HiP alone (dense found 0 of
  # 44 there, group 32), at 4K and 8K dense beside it; then RULER and pass key
  for cell in "16k prose" "16k repeat" "32k prose" "32k repeat"; do
    set -- $cell
    run 110 kvtier eval niah --lengths "$1" --depths 0:100:10 --samples 3 --haystack "$2" --device cuda \
      --method hip,hip_preset=long --no-progress --out "$OUT/niah_smollm2_cuda_$1_$2_x3.json"
  done
  run 120 kvtier eval niah --lengths 4k,8k --depths 0:100:10 --samples 3 --haystack prose --device cuda \
    --method auto --method hip,hip_preset=long --no-progress --out "$OUT/niah_smollm2_cuda_4k8k_prose_x3.json"
  ;;
37)
  # issue 19 (GGUF): RULER-style subtasks, dense at 4K against HiP at 16K; pass key past 8K
  run 200 kvtier eval ruler --lengths 4k --samples 5 --device cuda --method auto --no-progress \
    --out "$OUT/ruler_smollm2_cuda_4k_dense.json"
  run 200 kvtier eval ruler --lengths 16k --samples 5 --device cuda --method hip,hip_preset=long \
    --no-progress --out "$OUT/ruler_smollm2_cuda_16k_hip.json"
  run 150 kvtier eval passkey --lengths 16k,32k --samples 10 --device cuda --max-model-len 33000 \
    --method auto --method hip,hip_preset=long --no-progress --out "$OUT/passkey_smollm2_cuda.json"
  ;;
33)
  # after 22 (its llama8b folder and the GGUF in place): issue 19's speed through the CLI, HiP
  # against lossless auto at 128K and 512K under 24 GiB (KV computed from a prose prompt)
  run 560 $py bench/hip_cli_speed.py --contexts 128K,512K --methods "auto;hip"
  ;;
34)
  # issue 19: the README's HiP-over-offload rows again, on structured KV (no repetition, planted
  # needles; before, one random 64 MiB extent repeated), as the engine plans them
  run 330 $py bench/hip_offload.py --contexts 512K --presets fast --policy planned --steps 34 \
    --dense-steps 2 --prefill-chunk 16384 --name hip_offload_planned_512k_structured
  run 200 $py bench/hip_offload.py --contexts 128K --presets fast --policy planned --steps 34 \
    --dense-steps 4 --name hip_offload_planned_128k_structured
  ;;
46)
  # after the GGUF's two-call setup: the smoke's plan/eval/serve part on both models (the server
  # lends pool pages to HiP and Quest requests since 37ebebf/804b1f1), then the generate part's
  # embedded checks
  run 270 $py bench/gpu_smoke.py --sections plan,eval,serve --out "$OUT/gpu_smoke_serve.json"
  run 200 $py bench/gpu_smoke.py --models embedded --sections generate --jobs 4 \
    --out "$OUT/gpu_smoke_generate_embedded.json"
  ;;
47)
  # issue 19's 512K through the CLI (GGUF for the tokenizer): lossless against `hip` (auto: lean
  # past Llama-3.1's 128K); the HiP warm-up run (8 tokens, untimed, at 160K: lean too) compiles first
  run 580 $py bench/hip_cli_speed.py --contexts 512K --methods "auto;hip" --new-tokens 16 --timeout 300 \
    --warmup-context 160K --name hip_cli_speed_512k
  ;;
48)
  # issue 19's pass key as the issue asks it (dense at 4K against HiP past the trained length,
  # now `lean` through auto) and RULER 16K with `long` beside the x10 `lean` run (GGUF)
  run 200 kvtier eval passkey --lengths 4k --samples 10 --device cuda --method auto --no-progress \
    --out "$OUT/passkey_smollm2_cuda_4k_dense_x10.json"
  run 200 kvtier eval passkey --lengths 16k,32k --samples 10 --device cuda --max-model-len 33000 \
    --method hip --no-progress --out "$OUT/passkey_smollm2_cuda_hip_auto_x10.json"
  run 190 kvtier eval ruler --lengths 16k --samples 10 --device cuda --method hip,hip_preset=long \
    --no-progress --out "$OUT/ruler_smollm2_cuda_16k_long_x10.json"
  ;;
49)
  # issue 19 after a11cdab (`lean`, which `auto` runs past the trained length, scores 256-token
  # first-stage chunks, as `fast` does; with 32 it prefilled half as fast at 160K). GGUF. HiP alone
  # at 512K (the lossless row is in hip_cli_speed_512k.json: 3,692 tok/s prefill, 0.876 decode);
  # lean against fast at 160K again; the CLI's HiP at 128K with larger prefill chunks (the plan
  # picks 5,120; the bench's rows time 16K)
  run 260 $py bench/hip_cli_speed.py --contexts 512K --methods "hip" --new-tokens 16 --timeout 220 \
    --warmup-context 160K --name hip_cli_speed_512k_hip
  run 110 $py bench/hip_cli_speed.py --contexts 160K --methods "hip;hip,hip_preset=fast" --new-tokens 8 \
    --warmup-tokens 0 --timeout 80 --name hip_cli_speed_160k_lean_fast_b
  run 200 $py bench/hip_cli_speed.py --contexts 128K --methods "hip;hip,chunk_size=8192;hip,chunk_size=16384" \
    --timeout 80 --name hip_cli_speed_128k_chunks
  ;;
51)
  # issue 19: HiP at 512K through the CLI after c592dce (pruning batches sized on their largest
  # stage; before it `lean` ran out of memory there), then the embedded smoke's generate part
  run 420 $py bench/hip_cli_speed.py --contexts 512K --methods "hip" --new-tokens 16 --timeout 300 \
    --warmup-context 160K --name hip_cli_speed_512k_hip_b
  run 160 $py bench/gpu_smoke.py --models embedded --sections generate --jobs 4 \
    --out "$OUT/gpu_smoke_generate_embedded.json"
  ;;
52)
  # issue 19 after c592dce/the in-place softmax score: `lean` prunes 7 blocks a batch where it took
  # up to ~54 at 160K (more launches); its prefill there was 6,584 tok/s at 20e2632 (GGUF)
  run 110 $py bench/hip_cli_speed.py --contexts 160K --methods "hip;hip,hip_preset=fast" --new-tokens 8 \
    --warmup-tokens 0 --timeout 80 --name hip_cli_speed_160k_lean_fast_c
  ;;
53)
  # issue 19: each pruning stage batched on its own bytes (at 99556c2 every stage took the last
  # stage's 7 blocks and lean's 160K prefill fell to 4,616 tok/s from 6,584); then the smoke's
  # embedded generate part (GPU-facing code changed). GGUF.
  run 170 $py bench/hip_cli_speed.py --contexts 160K --methods "hip;hip,hip_preset=fast" --new-tokens 8 \
    --warmup-tokens 0 --timeout 80 --name hip_cli_speed_160k_lean_fast_d
  run 160 $py bench/gpu_smoke.py --models embedded --sections generate --jobs 4 \
    --out "$OUT/gpu_smoke_generate_embedded.json"
  ;;
54)
  # issue 19: HiP at 512K through the CLI with per-stage pruning batches (4,690 tok/s prefill,
  # 7.47 decode at 99556c2). GGUF.
  run 420 $py bench/hip_cli_speed.py --contexts 512K --methods "hip" --new-tokens 16 --timeout 300 \
    --warmup-context 160K --name hip_cli_speed_512k_hip_c
  ;;
55)
  # issue 19: where HiP's 512K decode goes (7.28 tok/s over 16 tokens at 5f5d2dd, 8.3x lossless):
  # the rows now carry each decode step's time (min/p50/p90/max) and the decode's H2D bytes; 64
  # tokens, so lean's stage-0 refresh (every 16 steps; it streams the whole slice) recurs. GGUF.
  # Then lean with fast's refresh (--hip-refresh fast: stage 0 every 32 steps).
  run 540 $py bench/hip_cli_speed.py --contexts 512K --methods "hip;hip,hip_refresh=fast" --new-tokens 64 \
    --timeout 220 --warmup-context 160K --name hip_cli_speed_512k_hip_steps
  ;;
62)
  # issue 19 at 128K: lossless `auto` and `hip` with the plan's 5,120-token chunk and with 8,192,
  # one machine, twice each (at 8a6ffda-c394132 5,120 gave 1.39-1.44x of a lossless run from
  # another machine start, 8,192 1.49-1.51x; the issue asks 1.5x prefill, 3x decode). Decides
  # whether `hip_chunk_size` should not go below 8K. No GGUF.
  run 280 $py bench/hip_cli_speed.py --contexts 128K --methods "auto;hip;hip,chunk_size=8192;auto;hip;hip,chunk_size=8192" \
    --new-tokens 64 --timeout 60 --name hip_cli_speed_128k_ab
  ;;
61)
  # issue 19 after 3470185 (a block cache's missed runs, packed int4 rows too, read by one
  # Triton launch from pinned host memory): 1M over int4 as in 59 (fast: 0.221 s/token
  # amortized at 9fcd0cb, steps that rerun nothing 0.077-0.09 s with 126 streamed slices of 2
  # KV heads), with one step of each kind profiled after the timed ones (--profile-decode:
  # where a step that reruns nothing spends its ~0.6 ms a slice). Then 512K through the CLI
  # (9.05 tok/s over 64 tokens at 07ef87e). No GGUF; the llama8b folder is written first.
  run 330 $py bench/hip_offload.py --contexts 1M --presets fast --policy planned --steps 34 \
    --no-dense --kv-quant int4 --profile-decode --name hip_offload_planned_1m_int4_gather
  run 250 $py bench/hip_cli_speed.py --contexts 512K --methods "hip" --new-tokens 64 \
    --timeout 240 --warmup-tokens 0 --name hip_cli_speed_512k_hip_gather
  ;;
60)
  # issues 18 and 19 after c6980e4 (paged decode's splits merged in one launch) and 3470185 (a
  # block cache's missed runs read by one Triton launch from pinned host memory). No GGUF.
  # The two kernels on CUDA (tests), one stream's decode step at 1K and 32K (serve_gpu c1,
  # c1-32k; serve_profile B=1 at 1K: 5.705 ms/step before), the 512K stage-1 rerun profile
  # (174 ms a step of 8 slices before, ~455 copies a slice).
  run 80 $py -m pytest -q -x -p no:cacheprovider tests/test_paged_decode.py tests/test_host_gather.py
  run 45 $py bench/serve_profile.py --batches 1 --context 1024 --top 30 --name serve_profile_b1_merge
  run 70 $py bench/hip_decode_profile.py --as-preset --preset lean --context 512K --layers 8 --kv-heads 8 \
    --group 8 --head-dim 128 --cache-tokens 16384 --steps 17 --kv-fill structured --profile --kernels \
    --profile-steps stage1 --name hip_decode_profile_lean_512k_gather
  run 110 $py bench/serve_gpu.py --cases c1,c1-32k --name serve_gpu_c1_merge
  ;;
59)
  # issue 19's 1M decode after 07ef87e/3483d96 (a step's missed runs in one fetch, over packed
  # int4 rows in one copy and one unpack; 0.281 s/token amortized at ca9057c-era code, steps
  # after a refresh 0.195 s with a third of the cache reads missing). No GGUF. `fast` as before,
  # then `lean` (what `auto` runs past the trained length) without its dense rows.
  run 300 $py bench/hip_offload.py --contexts 1M --presets fast --policy planned --steps 34 \
    --dense-steps 2 --kv-quant int4 --prefill-chunk 16384 --name hip_offload_planned_1m_int4_runs
  run 250 $py bench/hip_offload.py --contexts 1M --presets lean --policy planned --steps 66 \
    --no-dense --kv-quant int4 --name hip_offload_planned_1m_int4_lean
  # where a 512K stage-1 rerun's ~0.38 s goes (8 of Llama-3's 32 layers, lean's own budgets,
  # the CLI's 16K-token block cache): step times by the stage they rerun, cProfile of stage 1
  run 150 $py bench/hip_decode_profile.py --as-preset --preset lean --context 512K --layers 8 \
    --kv-heads 8 --group 8 --head-dim 128 --cache-tokens 16384 --steps 34 --kv-fill structured \
    --profile --profile-steps stage1 --name hip_decode_profile_lean_512k
  ;;
58)
  # issue 19 after 07ef87e (a refresh's missed runs fetched in one call; lean reruns stage 0
  # every 32 steps, stages 1/2 every 8/4): 512K decode over 64 tokens with the default `hip`
  # (auto: lean), warm-up at 16K (Triton's compile); NIAH prose 16K/32K x3 with the default.
  # Then lean with the paper's 16/8/4 (the fetch fix alone; 4.57 tok/s at 17115b0). GGUF.
  run 300 $py bench/hip_cli_speed.py --contexts 512K --methods "hip" --new-tokens 64 \
    --timeout 240 --warmup-context 16K --name hip_cli_speed_512k_hip_lean32
  run 150 kvtier eval niah --lengths 16k,32k --depths 0:100:10 --samples 3 --haystack prose --device cuda \
    --max-model-len 33000 --method hip --no-progress --out "$OUT/niah_smollm2_cuda_prose_hip_auto_x3.json"
  run 200 $py bench/hip_cli_speed.py --contexts 512K --methods "hip,hip_refresh=default" --new-tokens 64 \
    --timeout 190 --warmup-tokens 0 --name hip_cli_speed_512k_hip_refresh_default
  ;;
57)
  # issue 19: is lean as good with fast's refresh (32/16/8 where its own is 16/8/4)? NIAH prose
  # and pass key past the trained length, as groups 43 and 50 measured lean itself. GGUF.
  run 250 kvtier eval niah --lengths 16k,32k --depths 0:100:10 --samples 3 --haystack prose --device cuda \
    --max-model-len 33000 --method hip,hip_refresh=fast --no-progress \
    --out "$OUT/niah_smollm2_cuda_prose_lean_refresh_fast_x3.json"
  run 200 kvtier eval passkey --lengths 16k,32k --samples 10 --device cuda --max-model-len 33000 \
    --method hip,hip_refresh=fast --no-progress --out "$OUT/passkey_smollm2_cuda_hip_refresh_fast_x10.json"
  ;;
56)
  # issue 19: what a keys-only decode refresh could save (the stage-0 refresh streams keys and
  # values; the scores need keys alone): DMA of a whole slice against zero-copy Triton reads of
  # its keys from pinned host memory, scored in place, and a block gather. No GGUF. ~1 min.
  run 120 $py bench/host_key_read.py --check --tokens 512K --heads 8 --name host_key_read_512k_h8
  run 120 $py bench/host_key_read.py --tokens 1M --heads 4 --name host_key_read_1m_h4
  ;;
50)
  # issue 19's pass key after d616a67 (the question asks for the number alone; the old one got 0/10
  # dense at 4K), then RULER 16K `long` beside the x10 `lean` run. GGUF.
  run 100 kvtier eval passkey --lengths 4k --samples 10 --device cuda --method auto --no-progress \
    --out "$OUT/passkey_smollm2_cuda_4k_dense_x10.json"
  run 200 kvtier eval passkey --lengths 16k,32k --samples 10 --device cuda --max-model-len 33000 \
    --method hip --no-progress --out "$OUT/passkey_smollm2_cuda_hip_auto_x10.json"
  run 190 kvtier eval ruler --lengths 16k --samples 10 --device cuda --method hip,hip_preset=long \
    --no-progress --out "$OUT/ruler_smollm2_cuda_16k_long_x10.json"
  ;;
45)
  # issue 23 after the sixteenth session's packed kernel (4/8-bit rows attended from the codes,
  # 1.3-1.5x per core on the dev machine; fp8 rows natively) and the packed CPU split: the kernel's rates on the
  # H200's host (the planner measures them at start with --cpu-attention auto), the GPU checks,
  # then 512K int4 decode with the link alone, the planner's split (auto) and fixed counts
  run 80 $py bench/cpu_attention_rows.py --threads 1,8,15 --name cpu_attention_rows_h200_direct
  run 60 $py bench/gpu_checks.py
  run 330 $py bench/tiered_store.py --contexts 512K --policies auto+int4,auto+fp8 --cpu-attention off,auto,12 \
    --full-prefill-max 1 --gpu-memory 24GiB --decode-steps 4 --name cpu_attention_int4_512k_direct
  ;;
44)
  # issue 19 (GGUF: the two-call setup first; hip_cli_speed needs its tokenizer). The CLI at 128K
  # with lossless, `auto` (fast within Llama-3.1's 128K) and `default` in one call, twice: the
  # sixteenth session's one run of `auto` prefilled 6,280 tok/s where `default` had 10,855 in an
  # earlier call; then RULER at 16K, `lean` against `long`, 10 samples a subtask
  run 170 $py bench/hip_cli_speed.py --contexts 128K --methods "auto;hip;hip,hip_preset=default" \
    --name hip_cli_speed_128k_presets
  run 150 $py bench/hip_cli_speed.py --contexts 128K --methods "auto;hip;hip,hip_preset=default" \
    --name hip_cli_speed_128k_presets_b
  run 250 kvtier eval ruler --lengths 16k --samples 10 --device cuda --method hip,hip_preset=lean \
    --method hip,hip_preset=long --no-progress --out "$OUT/ruler_smollm2_cuda_16k_lean_long_x10.json"
  ;;
43)
  # issue 19 (GGUF: the two-call setup first): the lean preset on the rest of the grid; if it
  # holds on repeat and at 4K/8K it replaces long as the extension default
  for cell in "16k repeat" "32k repeat"; do
    set -- $cell
    run 90 kvtier eval niah --lengths "$1" --depths 0:100:10 --samples 3 --haystack "$2" --device cuda \
      --max-model-len 33000 --method hip,hip_preset=lean --no-progress --out "$OUT/niah_smollm2_cuda_$1_$2_lean_x3.json"
  done
  run 90 kvtier eval niah --lengths 4k,8k --depths 0:100:10 --samples 3 --haystack prose --device cuda \
    --method hip,hip_preset=lean --no-progress --out "$OUT/niah_smollm2_cuda_4k8k_prose_lean_x3.json"
  run 200 kvtier eval ruler --lengths 16k --samples 5 --device cuda --method hip,hip_preset=lean \
    --no-progress --out "$OUT/ruler_smollm2_cuda_16k_lean.json"
  run 120 $py bench/hip_small_prefill.py --lengths 16K,32K --methods "hip,hip_preset=long;hip,hip_preset=lean" \
    --repeats 2 --name hip_small_prefill_lean
  ;;
42)
  # issue 19's 1M plan (no GGUF): HiP over int4 KV (the pair now composes) at 1M under 24 GiB,
  # the engine's plan, structured KV; int4 alone (dense over the packed KV) beside it; then the
  # CLI's own run of the pair at 128K against lossless and HiP alone (the CLI-speed bench)
  run 420 $py bench/hip_offload.py --contexts 1M --presets fast --policy planned --steps 34 \
    --dense-steps 2 --kv-quant int4 --prefill-chunk 16384 --name hip_offload_planned_1m_int4
  run 170 $py bench/hip_cli_speed.py --contexts 128K --methods "auto;hip;hip,kv_quant=int4" \
    --name hip_cli_speed_128k
  ;;
22)
  # the whole smoke, both parts (needs the GGUF: carry .gguf_a in the call before, see h200_prepare.sh)
  run 290 $py bench/gpu_smoke.py --sections generate --jobs 4 --out "$OUT/gpu_smoke_generate.json"
  run 260 $py bench/gpu_smoke.py --sections plan,eval,serve --out "$OUT/gpu_smoke_serve.json"
  ;;
20)
  # the third fix to try for the mixed case: free the allocator's cache once the long request's
  # prefill ends (its stream idle), instead of the retry that waits behind its queued decode
  run 150 $py bench/serve_gpu.py --gpu-memory 24GiB --cases c32,mixed --tiered-release-after-prefill \
    --name serve_gpu_24gib_release
  run 120 $py bench/serve_gpu.py --gpu-memory 24GiB --cases mixed --tiered-release-after-prefill \
    --name serve_gpu_24gib_release_b
  ;;
19)
  # the allocator's other fix: expandable segments (no per-stream fragments to free at the cap);
  # then the smoke's generate part (needs the GGUF: the two-call setup first)
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True run 150 $py bench/serve_gpu.py --gpu-memory 24GiB \
    --cases c32,mixed --name serve_gpu_24gib_expandable
  run 290 $py bench/gpu_smoke.py --sections generate --jobs 4 --out "$OUT/gpu_smoke_generate.json"
  ;;
13)
  run 290 $py bench/gpu_smoke.py --sections generate --jobs 4 --out "$OUT/gpu_smoke_generate.json"
  run 60 $py bench/gpu_checks.py
  ;;
esac
