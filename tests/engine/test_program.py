"""Programs: the local part reaches the first global operator, steps fold and fuse, cut points and modules
(incrinf.engine.program)."""

import pytest
import torch
import torch.nn as nn
from conftest import zoo_model

from incrinf.engine import Program
from incrinf.graph import NodeKind, capture
from incrinf.graph.execute import materialize


def _program(model: nn.Module, shape=(3, 64, 64)) -> Program:
    graph = capture(model, shape)
    env, mutated = materialize(graph, torch.randn(1, *shape), track_mutation=True)
    return Program(graph, env, mutated)


@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v2", "shufflenet_v2_x1_0", "densenet121",
                                  "efficientnet_lite0"])
def test_every_window_before_the_first_global_operator_is_a_step(name):
    program = _program(zoo_model(name))
    graph = program.graph
    first_global = next(i for i, n in enumerate(graph.nodes) if n.kind == NodeKind.GLOBAL)
    windows = {n.name for n in graph.nodes[:first_global] if n.kind == NodeKind.LOCAL}
    heads = {s.head.name for s in program.steps}
    assert windows <= heads, sorted(windows - heads)[:5]
    assert program.cuts and program.boundary
    # batch norms after convolutions are folded, not run as steps
    assert not any(s.head.operator.value == "batch_norm" and s.inputs and
                   graph.by_name[s.inputs[0]].operator.value == "conv" and len(graph.by_name[s.inputs[0]].users) == 1
                   for s in program.steps)


def test_generated_modules_equal_the_model():
    model = zoo_model("resnet18")
    program = _program(model)
    x = torch.randn(1, 3, 64, 64)
    env, _ = materialize(program.graph, x)
    with torch.no_grad():
        out, tensors = program.full(x)
        torch.testing.assert_close(out, model(x))
        for name, t in zip(program.cached, tensors):
            torch.testing.assert_close(t, env[name])
        cut = sorted(program.cuts, key=program.cached.index)[1]
        out, later = program.suffix(cut, env[cut], x, True)
        torch.testing.assert_close(out, model(x))
        assert [n for n in program.cached_after(cut)] and len(later) == len(program.cached_after(cut))
        tail = program.tail()(*[env[name] for name in program.boundary])
        torch.testing.assert_close(tail, model(x))
