"""The server's own Prometheus histogram type."""


def test_histogram_exposition_matches_prometheus_clients():
    # the server's histograms take a step's tokens in one call (not one observe per token); what
    # a scrape reads is what prometheus_client's own histogram gives for the same observations
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client import Histogram as Reference

    from tensorrt_llm.serve.metrics import LATENCY_BUCKETS, Histogram

    ours, theirs = CollectorRegistry(), CollectorRegistry()
    mine = Histogram("x_seconds", "latency", LATENCY_BUCKETS, ours)
    reference = Reference("x_seconds", "latency", buckets=LATENCY_BUCKETS, registry=theirs)
    for value, count in [(0.0005, 1), (0.001, 2), (0.003, 3), (0.25, 1), (7.0, 4), (900.0, 1)]:
        mine.observe(value, count)
        for _ in range(count):
            reference.observe(value)

    def samples(registry) -> list[str]:
        text = generate_latest(registry).decode()
        return [line for line in text.splitlines() if line[0] != "#" and "_created" not in line]

    assert samples(ours) == samples(theirs)
    assert "x_seconds_count 12.0" in samples(ours)
