"""What a NIXL agent's progress thread costs, spinning (the API's poll delay of 0) against waiting
for events (``disaggregation/agent.py``): the process's CPU seconds per second while two agents
sit idle, and the time of a READ between them, small and large, as a ratio in one run.

    python benchmarks/bench_nixl_agent.py [--device cuda] [--reads 200] [--idle-s 2]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from tensorrt_llm._torch.disaggregation.agent import PROGRESS_POLL_US, make_agent


def cpu_seconds() -> float:
    times = os.times()
    return times.user + times.system


def idle_cpu(seconds: float) -> float:
    start, began = cpu_seconds(), time.perf_counter()
    time.sleep(seconds)
    return (cpu_seconds() - start) / (time.perf_counter() - began)


def read_ms(reader, source, dst: torch.Tensor, src: torch.Tensor, mem: str, reads: int) -> float:
    device = dst.device.index or 0
    local = reader.get_xfer_descs([(dst.data_ptr(), dst.numel(), device)], mem)
    remote = reader.get_xfer_descs([(src.data_ptr(), src.numel(), device)], mem)
    began = time.perf_counter()
    for _ in range(reads):
        xfer = reader.initialize_xfer("READ", local, remote, source, b"")
        state = reader.transfer(xfer)
        while state not in ("DONE", "ERR"):
            state = reader.check_xfer_state(xfer)
        reader.release_xfer_handle(xfer)
        if state == "ERR":
            raise RuntimeError("READ failed")
    return (time.perf_counter() - began) / reads * 1e3


def measure(poll_us: int, device: torch.device, reads: int, idle_s: float = 2.0) -> dict:
    mem = "VRAM" if device.type == "cuda" else "DRAM"
    owner = make_agent(f"bench-owner-{poll_us}", ["UCX"], poll_us=poll_us)
    reader = make_agent(f"bench-reader-{poll_us}", ["UCX"], poll_us=poll_us)
    result = {"poll_us": poll_us, "idle_cpu_per_s": idle_cpu(idle_s)}
    for label, nbytes in (("read_4k_ms", 4096), ("read_16m_ms", 1 << 24)):
        src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
        dst = torch.zeros_like(src)
        registrations = [owner.register_memory(src, mem), reader.register_memory(dst, mem)]
        reader.add_remote_agent(owner.get_agent_metadata())
        read_ms(reader, owner.name, dst, src, mem, 5)  # connect and warm up
        result[label] = read_ms(reader, owner.name, dst, src, mem, reads)
        assert torch.equal(src, dst)
        reader.remove_remote_agent(owner.name)
        owner.deregister_memory(registrations[0])
        reader.deregister_memory(registrations[1])
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--reads", type=int, default=200)
    parser.add_argument("--idle-s", type=float, default=2.0, help="seconds the agents sit idle")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    spinning = measure(0, device, args.reads, args.idle_s)
    waiting = measure(PROGRESS_POLL_US, device, args.reads, args.idle_s)
    ratios = {
        key: waiting[key] / spinning[key] for key in ("read_4k_ms", "read_16m_ms", "idle_cpu_per_s")
    }
    print(json.dumps({"device": str(device), "spinning": spinning, "waiting": waiting}, indent=1))
    print(json.dumps({"waiting / spinning": ratios}, indent=1))
    return {"spinning": spinning, "waiting": waiting, "waiting / spinning": ratios}


if __name__ == "__main__":
    main()
