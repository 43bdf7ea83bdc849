"""`split_model`: cuts a Keras model depth-wise into stages."""

import itertools
import math

import keras
import numpy as np

from tf_agn import _compat

BALANCES = ("params", "flops")


def split_model(model, num_stages=None, *, cut_after=None, balance="params"):
    """Cuts a Sequential or functional Keras model into consecutive stages.

    A cut must cross the graph at a single tensor, which one stage hands
    the next: not inside a residual block, where the skip connection and
    the branch both cross. Without `cut_after`, the cuts are chosen so that
    the largest stage is as small as possible, by parameter count or by
    estimated FLOPs per example. The stages share the model's layers, hence
    its weights; composed, they must reproduce the model's output on a
    random batch, or this raises.

    Example:

    ```python
    stages = split_model(model, 2, balance="flops")
    # or, naming the last layer of every stage but the last:
    stages = split_model(model, cut_after=["block1_out"])
    ```

    Args:
        model: a built `keras.Sequential` or functional `keras.Model` with
            one input and one output, calling each layer once.
        num_stages: K, the number of stages; with `cut_after`, optional.
        cut_after: the names of the layers after which to cut, in order;
            None chooses the cuts by `balance`.
        balance: "params" or "flops": what the chosen cuts balance.

    Returns:
        A list of K functional `keras.Model`s, stage k's output being stage
        k + 1's input.

    Raises:
        ValueError: if `model` is not a Keras model, or not functional
            with one input and one output, `num_stages` is not an int >= 1
            or exceeds the number of places the model can be cut at + 1,
            `cut_after` names an unknown layer, a layer out of order or one
            whose output is not a single-tensor boundary, `num_stages`
            disagrees with `cut_after`, `balance` is unknown, or the stages
            do not reproduce the model.
    """
    if not isinstance(model, keras.Model):
        raise ValueError(
            "model must be a built keras.Sequential or functional "
            f"keras.Model; received {model!r}."
        )
    if balance not in BALANCES:
        raise ValueError(
            f"Unknown balance {balance!r}. Allowed: {', '.join(BALANCES)}."
        )
    nodes, inputs, output = _graph(model)
    boundaries = _single_tensor_boundaries(nodes, inputs)
    if cut_after is None:
        _check_num_stages(num_stages, len(nodes), model)
        if num_stages - 1 > len(boundaries):
            raise ValueError(
                f"Model {model.name!r} cannot be cut into {num_stages} "
                f"stages: it has {len(boundaries)} single-tensor boundaries, "
                f"after layers {[nodes[i].operation.name for i in boundaries]}"
                f"; at most {len(boundaries) + 1} stages are possible."
            )
        costs = [_cost(node, balance) for node in nodes]
        cuts = _balanced_cuts(costs, boundaries, num_stages)
    else:
        cuts = _named_cuts(nodes, boundaries, list(cut_after))
        if num_stages is not None and num_stages != len(cuts) + 1:
            raise ValueError(
                f"num_stages={num_stages!r} disagrees with cut_after="
                f"{list(cut_after)}, which makes {len(cuts) + 1} stages."
            )
    tensors = [inputs] + [nodes[i].output_tensors[0] for i in cuts] + [output]
    stages = [
        keras.Model(start, end, name=f"{model.name}_stage{k}")
        for k, (start, end) in enumerate(itertools.pairwise(tensors))
    ]
    _check_round_trip(model, stages)
    return stages


def _graph(model):
    """The model's layer calls in a topological order, input and output."""
    inputs = getattr(model, "inputs", None)
    outputs = getattr(model, "outputs", None)
    if not inputs or not outputs or len(inputs) != 1 or len(outputs) != 1:
        raise ValueError(
            f"Model {model.name!r} cannot be cut: split_model needs a built "
            "Sequential or functional model with one input and one output "
            f"(a subclassed model has no graph to cut). Received {model!r}; "
            "pass its stages to DecoupledModel yourself instead."
        )
    graph = keras.Model(inputs, outputs)
    # Deeper nodes are farther from the output: descending depth is a
    # topological order.
    by_depth = _compat.nodes_by_depth(graph)
    nodes = [
        node
        for depth in sorted(by_depth, reverse=True)
        for node in by_depth[depth]
        if not isinstance(node.operation, keras.layers.InputLayer)
    ]
    operations = [node.operation for node in nodes]
    shared = {op.name for op in operations if operations.count(op) > 1}
    if shared:
        raise ValueError(
            f"Model {model.name!r} cannot be cut: layers {sorted(shared)} are "
            "called more than once."
        )
    return nodes, inputs[0], outputs[0]


def _single_tensor_boundaries(nodes, inputs):
    """Indices i such that only node i's output crosses a cut after it."""
    producer = {id(inputs): -1}
    for i, node in enumerate(nodes):
        for tensor in node.output_tensors:
            producer[id(tensor)] = i
    # The last node that reads each tensor.
    last_use = {}
    for i, node in enumerate(nodes):
        for tensor in node.input_tensors:
            last_use[id(tensor)] = i
    boundaries = []
    for i, node in enumerate(nodes[:-1]):
        crossing = {
            tensor for tensor, user in last_use.items() if producer[tensor] <= i < user
        }
        if len(node.output_tensors) == 1 and crossing == {id(node.output_tensors[0])}:
            boundaries.append(i)
    return boundaries


def _check_num_stages(num_stages, num_layers, model):
    """Raises unless `num_stages` is an int from 1 to `num_layers`."""
    if (
        isinstance(num_stages, bool)
        or not isinstance(num_stages, int)
        or not 1 <= num_stages <= num_layers
    ):
        raise ValueError(
            f"num_stages must be an int from 1 to the number of layers of "
            f"model {model.name!r}, {num_layers}; received {num_stages!r}."
        )


def _named_cuts(nodes, boundaries, names):
    """The node indices of the layers `names`, checked to be boundaries, in
    order."""
    index = {node.operation.name: i for i, node in enumerate(nodes)}
    allowed = [nodes[i].operation.name for i in boundaries]
    cuts = []
    for name in names:
        if name not in index:
            raise ValueError(
                f"cut_after names no layer of the model: {name!r}. "
                f"Allowed: {allowed}."
            )
        if index[name] not in boundaries:
            raise ValueError(
                f"Cannot cut after layer {name!r}: more than its output "
                "crosses that point (inside a residual block or a branch), "
                f"or it is the last layer. Allowed: {allowed}."
            )
        if cuts and index[name] <= cuts[-1]:
            raise ValueError(
                f"cut_after must follow the model's order; {name!r} comes "
                f"before or at {nodes[cuts[-1]].operation.name!r}."
            )
        cuts.append(index[name])
    return cuts


def _cost(node, balance):
    """A node's parameter count, or its estimated FLOPs per example."""
    params = node.operation.count_params() if node.operation.weights else 0
    if balance == "params":
        return params
    # FLOPs: a layer with weights costs 2 x its parameters x its output's
    # spatial positions, as a dense or convolution layer does; every layer
    # also costs one per output element.
    shape = node.output_tensors[0].shape[1:]
    positions = math.prod(d or 1 for d in shape[:-1])
    return 2 * params * positions + math.prod(d or 1 for d in shape)


def _balanced_cuts(costs, boundaries, num_stages):
    """The cuts, among `boundaries`, minimizing the largest stage's cost,
    then the sum of squared stage costs."""
    prefix = np.concatenate([[0], np.cumsum(costs, dtype=np.float64)])
    ends = boundaries + [len(costs) - 1]  # a stage ends after one of these

    def stage_cost(after, end):  # nodes after..end, after excluded
        return prefix[end + 1] - prefix[after + 1]

    # plans[j]: (largest cost, sum of squared costs, cuts) of the best split
    # of nodes up to ends[j] into the stages so far. Dynamic programming:
    # at most K x (cut points)^2 steps. The squares break ties towards the
    # most even cuts, so no stage is left nearly empty while another could
    # take some of its neighbour's layers.
    plans = {
        j: (cost, cost**2, [])
        for j, cost in enumerate(stage_cost(-1, end) for end in ends)
    }
    for _ in range(1, num_stages):
        plans = {
            j: min(
                (
                    max(plans[i][0], cost),
                    plans[i][1] + cost**2,
                    plans[i][2] + [ends[i]],
                )
                for i in range(j)
                if i in plans
                for cost in [stage_cost(ends[i], ends[j])]
            )
            for j in range(1, len(ends))
            if any(i in plans for i in range(j))
        }
    return plans[len(ends) - 1][2]


def _check_round_trip(model, stages):
    """Raises unless the composed `stages` reproduce `model` on a random
    batch."""
    shape = [2] + [d or 2 for d in model.inputs[0].shape[1:]]
    x = np.random.default_rng(0).uniform(size=shape).astype("float32")
    expected = keras.ops.convert_to_numpy(model(x, training=False))
    composed = x
    for stage in stages:
        composed = stage(composed, training=False)
    composed = keras.ops.convert_to_numpy(composed)
    if not np.allclose(composed, expected, rtol=1e-5, atol=1e-6):
        raise ValueError(
            f"The stages of model {model.name!r} do not reproduce its output "
            f"(largest difference {np.max(np.abs(composed - expected))}); "
            "does it use layers whose call depends on more than its inputs?"
        )
