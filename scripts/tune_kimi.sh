#!/usr/bin/env bash
# Regenerate the committed tuned configs for the Kimi-K2.5 + EAGLE-3 shapes (static mode: no GPU
# needed). Usage: bash scripts/tune_kimi.sh [group ...]   groups: moe mla mha step tp mxfp4 draft (default: moe mla mha).
# "step" tunes every kernel the Kimi decode/verify step launches (autotune tune-model, both expert
# formats, M buckets 1..128); STEP_FLAGS adds flags to it (e.g. "--skip-tuned --max-candidates 12").
# "tp" tunes the per-GPU shapes of the deployments: TP8 on gfx942 (MI300X/MI325X), TP4 and TP8 on gfx950
# (MI355X), tensor-parallel experts (intermediate / N) and expert-parallel EP8 (E / 8 whole experts).
# Extra flags for every run go in TUNE_FLAGS, e.g. TUNE_FLAGS="--mode measured --arch current".
set -euo pipefail
cd "$(dirname "$0")/.."
ARCHS=${ARCHS:-"gfx942 gfx950"}
MS="1,2,4,8,16,32,64,128,256,any"
run() {  # kernel problem [max-candidates]
  for arch in $ARCHS; do
    python -m autotune tune "$1" --problem "$2" --m "$MS" --arch "$arch" --max-candidates "${3:-48}" --in-place \
      --quiet ${TUNE_FLAGS:-}
  done
}
moe() {  # Kimi routed experts: E=384, top-8, hidden 7168, expert intermediate 2048
  run moe_gate_gemm E=384,H=7168
  run moe_stage1_w4a8 E=384,K=7168,I=2048,TOPK=8
  run moe_stage2_w4a8_pq E=384,H=7168,I=2048,TOPK=8
  run moe_stage1_w4a16 E=384,K=7168,I=2048,TOPK=8
  run moe_stage2_w4a16 E=384,H=7168,I=2048,TOPK=8
}
mla() {  # Kimi MLA decode: 64 heads, latent 512 + rope 64, page 64; M = batch x q_len for batch 1..64
  # (q_len 1: decode; q_len 4: EAGLE-3 verify); 0 = every candidate (a few hundred)
  run mla_decode_split QL=1,H=64,DL=512,DR=64,PS=64 0
  MS="4,8,16,32,64,128,256,any" run mla_decode_split QL=4,H=64,DL=512,DR=64,PS=64 0
}
mha() {  # EAGLE-3 draft attention: 64 heads x 128 over its own paged cache (page 64), q_len 1 and 4
  run mha_decode QL=1,HQ=64,KVH=64,D=128,PS=64 24
  MS="4,8,16,32,64,128,256,any" run mha_decode QL=4,HQ=64,KVH=64,D=128,PS=64 24
}
mxfp4() {  # MXFP4 MoE stages at the MI355X deployment shapes: TP4 (I=512) and TP8 (I=256), gfx950
  for I in 256 512; do
    for v in "" _fp8 _bf16a; do   # W4A4, W4A8-FP8 and bf16-activation variants
      ARCHS=gfx950 MS="1,2,4,8,16,32,64,128" run moe_stage1_mxfp4$v E=384,K=7168,I=$I,TOPK=8 8
      ARCHS=gfx950 MS="1,2,4,8,16,32,64,128" run moe_stage2_mxfp4$v E=384,H=7168,I=$I,TOPK=8 8
    done
  done
}
step() {  # every kdsl launch of the recorded decode (q_len 1) and verify (q_len 4) step
  for arch in $ARCHS; do
    for experts in w4a8 w4a16; do
      python -m autotune tune-model --config kimi-k2.5 --experts "$experts" --arch "$arch" --in-place \
        --quiet ${STEP_FLAGS:-}
    done
  done
}
tp() {  # every kdsl launch of the step at the deployed per-GPU shapes (STEP_FLAGS as for "step")
  for spec in "gfx942 8" "gfx950 4" "gfx950 8"; do
    set -- $spec
    for experts in w4a8 w4a16; do
      for mp in tp ep; do
        [ "$mp" = ep ] && [ "$2" != 8 ] && continue
        python -m autotune tune-model --config kimi-k2.5 --experts "$experts" --arch "$1" --tp "$2" \
          --moe-parallel "$mp" --in-place --quiet ${STEP_FLAGS:-}
      done
    done
    if [ "$1" = gfx950 ]; then   # amd/Kimi-K2.5-MXFP4 on MI355X (W4A4 experts)
      python -m autotune tune-model --config kimi-k2.5 --experts mxfp4 --arch gfx950 --tp "$2" --in-place --quiet \
        ${STEP_FLAGS:-}
    fi
  done
}
draft() {  # every kdsl launch of the EAGLE-3 draft's step (TP1, replicated on every rank; bf16): q_len 1 draft
  # steps and the q_len 4 extend after verify, M buckets 1..128 (autotune tune-model --model draft); problems the
  # target's step launches too (lm_head, o_proj, rmsnorm) are left to "step". DRAFT_FLAGS adds flags to it
  # (e.g. "--skip-tuned --max-candidates 12 --workers 1").
  for arch in $ARCHS; do
    python -m autotune tune-model --model draft --draft-config kimi-k2.5-eagle3 --arch "$arch" --in-place \
      --quiet ${DRAFT_FLAGS:-}
  done
}
groups=("$@")
[ ${#groups[@]} -eq 0 ] && groups=(moe mla mha)
for g in "${groups[@]}"; do "$g"; done
