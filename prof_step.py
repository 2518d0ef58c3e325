import sys, time, tempfile, statistics, torch
sys.path.insert(0, "benchmarks")
from pathlib import Path
import bench_decode as bd
from tensorrt_llm.logger import logger
logger.set_level("warning")
s, args = bd.parse_args(["--device", "cuda", "--batches", "1", "--modes", "target"])
from tensorrt_llm._torch.pyexecutor import cuda_graph_runner as cgr, py_executor as pe
T = {}
def wrap(obj, name, key):
    f = getattr(obj, name)
    def g(*a, **k):
        torch.cuda.synchronize(); t = time.perf_counter(); r = f(*a, **k); torch.cuda.synchronize()
        T.setdefault(key, []).append(time.perf_counter() - t); return r
    setattr(obj, name, g)
with tempfile.TemporaryDirectory() as tmp:
    td, dd = bd.write_checkpoints(Path(tmp), s)
    for mode in ():
      for batch in (1, 64):
        llm = bd.make_llm(td, dd, mode, batch, s)
        vocab = llm.model_config.vocab_size
        llm.generate(bd.random_prompts(batch, s.prompt_len, vocab, 7), bd.SamplingParams(max_tokens=8, ignore_eos=True, temperature=0, detokenize=False))
        ex = llm.executor; r = ex.cuda_graph_runner
        T.clear()
        wrap(r, "_write_inputs", "write_inputs"); wrap(r, "_result", "result")
        wrap(ex.scheduler, "schedule", "schedule"); wrap(ex.resource_manager, "prepare_resources", "prepare"); wrap(ex.resource_manager, "update_resources", "update_res")
        wrap(ex, "_update_requests", "update_requests"); wrap(ex, "step", "step")
        res = bd.timed_run(llm, bd.random_prompts(batch, s.prompt_len, vocab, 0), s)
        g = r._buckets[batch].graph
        torch.cuda.synchronize(); t=time.perf_counter()
        for _ in range(50): g.replay()
        torch.cuda.synchronize(); rep=(time.perf_counter()-t)/50
        print(mode, batch, "step_ms", round(res["decode_step_ms"],3), "replay_ms", round(rep*1e3,3), {k: round(statistics.median(v)*1e3,3) for k,v in T.items()})
        llm.shutdown(); del llm; torch.cuda.empty_cache()
    # kernel breakdown of one eager step of the graph's work (target, batch 1)
    llm = bd.make_llm(td, dd, "target", 1, s)
    vocab = llm.model_config.vocab_size
    ex = llm.executor; r = ex.cuda_graph_runner
    from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest
    from tensorrt_llm import SamplingParams
    p = SamplingParams(max_tokens=40, ignore_eos=True, temperature=0, detokenize=False)
    req = LlmRequest(request_id=5, prompt_token_ids=bd.random_prompts(1, s.prompt_len, vocab, 0)[0], max_new_tokens=40, sampling_params=p, end_id=llm.eos_token_id)
    ex.enqueue_request(req)
    for _ in range(3): ex.step()
    batch = ex.scheduler.schedule(ex.active, ex._admitted)
    ex.resource_manager.prepare_resources(batch)
    from torch.profiler import profile, ProfilerActivity
    with torch.inference_mode():
        bucket = r._buckets.get(1) or r._new_bucket(1)
        md, cmd = r._write_inputs(bucket, batch)
        for _ in range(3): r._step(bucket, md, cmd)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            r._step(bucket, md, cmd); torch.cuda.synchronize()
    ev = [e for e in prof.key_averages()]
    tot = sum(e.device_time_total for e in ev)
    n = sum(e.count for e in ev if e.device_time_total > 0)
    print("kernels", n, "total_us", round(tot,1))
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=40))
