"""On CUDA, the model runner's decode graph: a plain decode step samples inside its graph, and a decode step
never blocks the host on the device (its uploads go through pinned buffers)."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


@pytest.fixture(scope="module")
def runner(gpu_qwen3_dir):
    from executor_svc.model_runner import ModelRunner
    from scheduler_svc.common.config import EngineConfig

    return ModelRunner(EngineConfig(model=gpu_qwen3_dir, device="cuda", num_gpu_blocks=256, max_num_seqs=16))


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
