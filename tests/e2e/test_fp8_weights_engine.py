"""FP8 weights through the whole engine on the CPU (real scheduler and executor processes): an FP8 checkpoint serves
the greedy tokens of HF transformers (fp32) on its dequantized weights, with the near-tie rule: the fine-grained 128
x 128 block format and a per-tensor one through gRPC on two tensor-parallel ranks (gloo; GetModelInfo names the
format), compressed-tensors' per-channel format, AutoFP8's per-tensor one (with static activation scales),
fbgemm_fp8's and compressed-tensors' FP8_BLOCK through the offline API. The tiny Llama's dimensions are not
multiples of 128 (hidden 192, intermediate 320, k/v 96 rows), so every weight has ragged blocks, and one layer's MLP
is listed as not converted. At -tp 2 the shard boundaries fall inside blocks: q's rows split at 96, gate's and up's
at 160, and down_proj's columns at 160 (K groups of 32 there). A tiny Qwen3-MoE stored as Qwen3-30B-A3B-FP8 is
(per-expert FP8 tensors and scales; hidden 192, moe_intermediate 160) does the same: each expert's rows split at 80
on two ranks, down_proj's K groups of 16."""
from __future__ import annotations

import os
import random
from types import SimpleNamespace

import pytest
from support.fp8_checkpoints import tiny_fp8_checkpoints, tiny_fp8_moe_checkpoints
from support.grpc_server import start_server
from support.hf_reference import assert_greedy_matches, hf_greedy

from protos import generation_pb2 as pb
from scheduler_svc.entrypoints.llm import LLM
from scheduler_svc.frontend.sampling_params import SamplingParams

NEW_TOKENS = 16


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    return {"llama": tiny_fp8_checkpoints(str(tmp_path_factory.mktemp("fp8_engine"))),
            "qwen3_moe": tiny_fp8_moe_checkpoints(str(tmp_path_factory.mktemp("fp8_moe_engine")))}


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(30)
    return [[rng.randrange(256) for _ in range(rng.randint(1, 70))] for _ in range(8)]


def as_outputs(completions) -> list[SimpleNamespace]:
    """gRPC CompletionOutputs in the shape assert_greedy_matches reads."""
    return [SimpleNamespace(token_ids=list(c.token_ids),
                            logprobs=[SimpleNamespace(top_token_ids=[t.token_id for t in lp.top_logprobs])
                                      for lp in c.logprobs]) for c in completions]


@pytest.mark.parametrize("model, scheme, converted", [
    ("llama", "block", "6 linear layers"),  # q/k/v, o, gate/up, down in layer 0; q/k/v and o in layer 1
    ("qwen3_moe", "block", "6 linear layers and 2 expert blocks"),  # q/k/v and o in 3 layers; the experts of 0, 2
    ("llama", "tensor", "6 linear layers"),  # a scale per tensor: q, k and v each their own, on both ranks' rows
])
def test_an_fp8_checkpoint_sharded_over_two_ranks_equals_transformers_on_its_dequantized_weights(
        checkpoints, prompts, tmp_path, model, scheme, converted):
    root = checkpoints[model]
    ref = hf_greedy(os.path.join(root, f"{scheme}_dequantized"), prompts, NEW_TOKENS)
    server = start_server(tmp_path, "--model", os.path.join(root, scheme), "--max-model-len", "128",
                          "--num-gpu-blocks", "64", "--tensor-parallel-size", "2")
    weight_format = "fp8_e4m3fn, 128x128 block scales" if scheme == "block" else "fp8_e4m3fn, per-tensor scales"
    try:
        info = server.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
        assert info.weight_format == weight_format and info.tensor_parallel_size == 2
        sampling = pb.SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=5)
        outs = [server.stub.Generate(pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=p), sampling=sampling),
                                     timeout=120).outputs[0] for p in prompts]
    finally:
        server.stop()
    assert_greedy_matches(as_outputs(outs), ref)
    assert f"fp8 weights ({weight_format}): {converted}, dequantized" in server.log()


@pytest.mark.parametrize("model, scheme", [
    ("llama", "channel"), ("qwen3_moe", "channel"),  # compressed-tensors, a scale per row
    ("llama", "tensor"), ("qwen3_moe", "tensor"),  # AutoFP8: a scale per tensor, static input_scale (not used)
    ("llama", "fbgemm"),  # fbgemm_fp8: a scale per row
    ("llama", "compressed_block"),  # compressed-tensors FP8_BLOCK: 128 x 128 blocks named weight_scale
    ("llama", "modelopt"), ("llama", "modelopt_block"),  # NVIDIA ModelOpt: FP8 per tensor; FP8_PB_WO's 4-D scales
    ("qwen3_moe", "modelopt"),  # a scale per expert projection
    ("llama", "quark"),  # AMD Quark: per tensor, static input scales (not used)
])
def test_the_other_fp8_checkpoint_formats_equal_transformers_on_their_dequantized_weights(checkpoints, prompts,
                                                                                            model, scheme):
    root = checkpoints[model]
    ref = hf_greedy(os.path.join(root, f"{scheme}_dequantized"), prompts, NEW_TOKENS)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=5)
    with LLM(os.path.join(root, scheme), num_gpu_blocks=64) as llm:
        outs = [r.outputs[0] for r in llm.generate(prompts, params, use_tqdm=False)]
    assert_greedy_matches(outs, ref)
