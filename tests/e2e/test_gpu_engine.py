"""On CUDA: greedy decoding of a random Qwen3 checkpoint with CUDA graphs equals the same run with
--enforce-eager, and equals the torch reference backend (ties judged by the top-5 rule)."""
from __future__ import annotations

import random

import pytest
import torch

from support.hf_reference import assert_greedy_matches
from scheduler_svc.frontend.sampling_params import SamplingParams
from support.tiny_checkpoints import make_tiny_qwen3

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

NEW_TOKENS = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=5)


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory) -> str:
    # realistic head_dim 128 and GQA 2:1 so the kernels run their production tile shapes
    path = str(tmp_path_factory.mktemp("qwen3_gpu"))
    return make_tiny_qwen3(path, hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                           vocab_size=1024, max_position_embeddings=2048)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(11)
    return [[rng.randrange(1024) for _ in range(rng.randint(1, 300))] for _ in range(24)]


def generate(model: str, prompts, params: SamplingParams = GREEDY, all_outputs: bool = False, **engine_args):
    """First completion per prompt (or, with all_outputs, every completion) and the stats."""
    from scheduler_svc.entrypoints.llm import LLM

    engine_args.setdefault("num_gpu_blocks", 4096)  # skip sizing the pool to the whole GPU
    with LLM(model, device="cuda", **engine_args) as llm:
        results = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.stats()
    if all_outputs:
        return [r.outputs for r in results], stats
    return [r.outputs[0] for r in results], stats


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graph_decoding_equals_eager_and_torch_backend(qwen3_dir, prompts, dtype):
    graphs, _ = generate(qwen3_dir, prompts, dtype=dtype, attention_backend="triton", max_num_seqs=32)
    eager, _ = generate(qwen3_dir, prompts, dtype=dtype, attention_backend="triton", enforce_eager=True)
    reference, _ = generate(qwen3_dir, prompts, dtype=dtype, attention_backend="torch", enforce_eager=True)
    ref_tokens = [o.token_ids for o in reference]
    # fp32 must agree outright; bf16 rounding on a random model leaves many near-ties, where only
    # the top-5 rule applies (each flip's reference token is still among our top 5)
    flips = 0.25 if dtype == "float32" else 1.0
    assert_greedy_matches(graphs, ref_tokens, max_flip_fraction=flips)
    assert_greedy_matches(eager, ref_tokens, max_flip_fraction=flips)
    assert_greedy_matches(graphs, [o.token_ids for o in eager], max_flip_fraction=flips)


def test_cuda_engine_with_chunked_prefill_preemption_and_prefix_hits(qwen3_dir, prompts):
    shared = prompts[0][:200]
    tricky = [shared + p[:50] for p in prompts[:8]] + prompts[8:]
    ref2, _ = generate(qwen3_dir, tricky, dtype="float32", attention_backend="torch", enforce_eager=True)
    outs, stats = generate(qwen3_dir, tricky, dtype="float32", attention_backend="triton", max_num_seqs=32,
                           num_gpu_blocks=60, max_num_batched_tokens=128)
    assert stats.num_preemptions > 0 and stats.num_partial_prefill_chunks > 0
    assert_greedy_matches(outs, [o.token_ids for o in ref2])


def test_cuda_engine_swapping_preempted_sequences_to_host_equals_the_reference(qwen3_dir, prompts):
    ref, _ = generate(qwen3_dir, prompts, dtype="float32", attention_backend="torch", enforce_eager=True)
    outs, stats = generate(qwen3_dir, prompts, dtype="float32", attention_backend="triton", max_num_seqs=32,
                           num_gpu_blocks=60, num_host_blocks=400, preemption_mode="swap")  # (auto may recompute)
    assert stats.num_swap_outs > 0
    assert_greedy_matches(outs, [o.token_ids for o in ref])


def test_greedy_sampled_inside_the_cuda_graph_equals_eager(qwen3_dir, prompts):
    """Without logprobs, greedy rows are sampled by the decode graph itself (logits and kernel captured)."""
    plain = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    graphs, _ = generate(qwen3_dir, prompts, params=plain, dtype="float32", attention_backend="triton",
                         max_num_seqs=32)
    eager, _ = generate(qwen3_dir, prompts, dtype="float32", attention_backend="triton", enforce_eager=True)
    assert_greedy_matches(eager, [o.token_ids for o in graphs])


def test_one_token_prefill_chunks_beside_decodes_stay_out_of_the_decode_graph(qwen3_dir):
    """A budget of max_num_seqs tokens leaves a prefilling prompt one token beside the decodes: every
    chunk is one token, but that one samples nothing, so the step must not take the graph's path of
    one logit row per chunk."""
    rng = random.Random(12)
    short = [[rng.randrange(1024) for _ in range(rng.randint(20, 40))] for _ in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True, logprobs=5)
    limits = dict(dtype="float32", attention_backend="triton", max_num_seqs=4, max_num_batched_tokens=4)
    graphs, stats = generate(qwen3_dir, short, params=params, **limits)
    eager, _ = generate(qwen3_dir, short, params=params, enforce_eager=True, **limits)
    assert stats.num_partial_prefill_chunks > 0
    assert_greedy_matches(graphs, [o.token_ids for o in eager])


@pytest.fixture(scope="module")
def runner(qwen3_dir):
    from executor_svc.model_runner import ModelRunner
    from scheduler_svc.common.config import EngineConfig

    return ModelRunner(EngineConfig(model=qwen3_dir, device="cuda", num_gpu_blocks=256, max_num_seqs=16))


def decode_batch(temperature: float, logprobs: int = 0):
    from executor_svc.seq_mirror import MirroredSeq
    from protos import engine_pb2

    options = engine_pb2.SamplingOptions(temperature=temperature, top_p=1.0, logprobs=logprobs)
    return [MirroredSeq(i, [(7 * i + t) % 1000 for t in range(40)], 20, list(range(4 * i, 4 * i + 4)), 39, options)
            for i in range(5)]


def decode_step(runner, seqs) -> list[int]:
    from executor_svc.seq_mirror import ScheduledChunk

    chunks = [ScheduledChunk(s, len(s.token_ids) - 1, len(s.token_ids)) for s in seqs]
    pending = runner.sample(runner.launch(chunks))
    tokens = [t.token_id for t in runner.finalize(pending)]
    for s, t in zip(seqs, tokens):
        s.token_ids.append(t)
        s.num_computed_tokens += 1
    return tokens


def test_a_plain_decode_step_samples_inside_its_cuda_graph(runner):
    from executor_svc.seq_mirror import ScheduledChunk

    seqs = decode_batch(0.0)
    chunks = [ScheduledChunk(s, len(s.token_ids) - 1, len(s.token_ids)) for s in seqs]
    inputs = runner.launch(chunks)
    assert inputs.sampled is not None, "greedy rows without logprobs sample in the graph"
    assert torch.equal(inputs.sampled, inputs.logits.float().argmax(dim=-1))
    runner.finalize(runner.sample(inputs))
    with_logprobs = runner.launch([ScheduledChunk(s, len(s.token_ids) - 1, len(s.token_ids))
                                   for s in decode_batch(0.0, logprobs=2)])
    assert with_logprobs.sampled is None, "logprobs take the eager sampler, from the graph's logits"
    runner.finalize(runner.sample(with_logprobs))


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_a_decode_step_never_blocks_the_host_on_the_device(runner, temperature):
    """Step inputs and sampling tensors go up through pinned buffers: a copy from pageable memory
    would wait for the whole stream, so the host could not prepare step N+1 while step N runs."""
    seqs = decode_batch(temperature)
    decode_step(runner, seqs)  # first-use allocations of the pinned buffers are allowed to block
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            decode_step(runner, seqs)
    copies = [e.name for e in prof.events() if "Memcpy" in e.name]
    assert any("Pinned -> Device" in name for name in copies)  # the profiler did see the uploads
    assert not [name for name in copies if "Pageable" in name], copies


def test_beam_search_and_forked_samples_on_cuda_equal_the_references(qwen3_dir, prompts):
    """Beams fork every step (copy-on-write block copies on the GPU) and decode through the graphs."""
    from support.hf_reference import hf_beam_search

    cases = [(prompts[i], 4, 2) for i in range(4)]
    refs = [hf_beam_search(qwen3_dir, p, w, n, 12, [4, 5]) for p, w, n in cases]
    beams, _ = generate(qwen3_dir, [p for p, *_ in cases], dtype="float32", attention_backend="triton",
                        max_num_seqs=32, all_outputs=True,
                        params=[SamplingParams(beam_width=w, n=n, max_tokens=12) for _, w, n in cases])
    beams = [[list(o.token_ids) for o in outs] for outs in beams]
    # fp32 on a random model: a near-tie may reorder one search's hypotheses, not most of them
    assert sum(b == r for b, r in zip(beams, refs)) >= 3, (beams, refs)
    many, _ = generate(qwen3_dir, prompts[:8], dtype="float32", attention_backend="triton", max_num_seqs=32,
                       all_outputs=True, params=SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS,
                                                               ignore_eos=True, logprobs=5, n=3))
    single, _ = generate(qwen3_dir, prompts[:8], dtype="float32", attention_backend="triton", max_num_seqs=32)
    for outs in many:  # greedy samples forked from one prompt agree with each other
        assert outs[0].token_ids == outs[1].token_ids == outs[2].token_ids
    # and with the single run, batched differently (near-ties judged by the top-5 rule)
    assert_greedy_matches([outs[2] for outs in many], [o.token_ids for o in single])
