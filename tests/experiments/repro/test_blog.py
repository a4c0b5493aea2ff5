import pytest

from experiments.repro import blog

# What blog.claims(200) computes: per-user tok/s, the TTFT disaggregation adds in ms, decode nodes per
# prefill node; the fixed step cost solved on r1-1p3d, so that row is 90 by construction
AT_200 = {
    "r1-1p3d": 90.0,
    "r1-mixed": 74.50,
    "r1-ttft-added": -5.06,
    "r1-dp": 21.67,
    "qwen3-coder-ratio": 12.23,
}


# make test-all: every row is a goodput sweep (30 s); make test keeps the decode node's batch rule
@pytest.mark.slow
def test_every_blog_row_keeps_its_value():
    claims = {c.key: c for c in blog.claims(200)}
    assert {k: c.ours for k, c in claims.items()} == pytest.approx(AT_200, rel=0.02, abs=0.2)
    assert [k for k, c in claims.items() if c.fitted] == ["r1-1p3d"]
    assert blog.step_overhead(200) == pytest.approx(0.0063, rel=0.05)


def test_a_decode_node_s_batch_is_the_largest_whose_step_fits():
    model = blog.sim_model("qwen3-coder-480b-a35b")
    qps, batch = blog.decode_node_qps(model, 0.005, 0.020)
    node = blog._prefill_node(model, 0.005)
    kv = blog.PROMPT + blog.OUTPUT // 2
    assert node.cost.decode_time([kv] * batch) <= 0.020 < node.cost.decode_time([kv] * (batch + 1))
    assert qps == pytest.approx(batch / (blog.OUTPUT * node.cost.decode_time([kv] * batch)))
    assert blog.decode_node_qps(model, 0.030, 0.020) == (0.0, 0)  # no batch fits: serves nothing
