"""Memory-centric tiling (ZeRO-Infinity's; DeepSpeed's ``TiledLinear``): a linear layer cut into a
grid of smaller linear tiles, each a parameter (and so, at stage 3, a partition) of its own.

At stage 3 strata lends each parameter to its module around that module's forward and backward.
A ``torch.nn.Linear`` is one parameter: the device must hold the whole matrix (and its gradient)
while it runs, which for the layers of the largest models is more than a GPU has (a 1T model's MLP
matrix: 2.6 billion parameters, 5.2 GB in bf16, and as much again of gradient). A ``TiledLinear``
computes the same product tile by tile, so the device needs one tile at a time (the scheduler
prefetching the next): its out_splits x in_splits tiles are ``torch.nn.Linear`` modules,
``tiles[o][i]`` mapping the i-th slice of the input features to the o-th slice of the output
features, and the output slice o is the sum of its row's products (the bias, when there is one,
belongs to the row's first tile). With in_splits 1 each output is the same dot product as the
Linear's (bit for bit on the CPU; a GPU's kernels, picked by shape, may differ in the last bits);
with more, the sums of the partial products are rounded once per tile and differ from it in the
last bits, as any blocked matrix product does.

``TiledLinear(in_features, out_features, bias=True, in_splits=1, out_splits=1)`` builds one (under
``strata.init`` each tile is partitioned as it is made, so the whole matrix never exists);
``TiledLinear.from_linear(linear, in_splits, out_splits)`` copies an existing Linear's weights;
``tile_linears(model, max_tile_params)`` replaces, in place, every ``torch.nn.Linear`` of a model
with more parameters than that by a TiledLinear whose tiles have at most that many (the fewest
tiles that do it, cut along the output features first; a weight tied to another module's, as a
language model's head to its embeddings, is left whole), and returns how many it replaced.
``module.weight_whole()`` (or ``module.weight``, for code that reads a Linear's weight: made on
each access, differentiable) gives the matrix back. A frozen Linear's tiles stay frozen. A tiled
module's state dict holds ``weight`` and ``bias`` whole, as the Linear it stands for saves them
(so save_pretrained writes what the untiled model loads), and loading one cuts them into its tiles
(with ``keep_vars=True`` the tiles' parameters are given, as they are). Tile before applying peft
(a peft adapter layer's Linears are refused). A
Linear whose weights are placeholders (built under strata.init) or on the meta device is refused:
build such a model with TiledLinear. Forward hooks on a replaced Linear, and references to it
held outside the module tree, are not carried over to its TiledLinear.

Thread safety: modules, as torch's.
"""

import math

import torch

__all__ = ["TiledLinear", "tile_linears"]


def _parts(total, splits, what):
    """`total` features cut into `splits` slices as even as can be (the first ones one larger)."""
    if isinstance(splits, bool) or not isinstance(splits, int) or not 1 <= splits <= total:
        raise ValueError(f"TiledLinear: {what}={splits!r}; accepted: an int from 1 to the "
                         f"{what.split('_')[0]}_features ({total})")
    base, extra = divmod(total, splits)
    return [base + (1 if k < extra else 0) for k in range(splits)]


class _Tile(torch.nn.Linear):
    """One tile: a Linear initialised as a slice of the whole matrix would be (torch's default
    bounds, 1/sqrt(fan_in), from the whole matrix's fan-in, not the tile's), in its own __init__
    (before strata.init partitions it)."""

    def __init__(self, in_features, out_features, bias, whole_in_features, device=None,
                 dtype=None):
        self._whole_in = whole_in_features  # read by reset_parameters, which __init__ calls
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)

    def reset_parameters(self):
        bound = 1 / math.sqrt(self._whole_in)
        torch.nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            torch.nn.init.uniform_(self.bias, -bound, bound)


class TiledLinear(torch.nn.Module):
    """y = x W^T + b computed by a grid of out_splits x in_splits Linear tiles (see the module's
    docstring)."""

    def __init__(self, in_features, out_features, bias=True, in_splits=1, out_splits=1,
                 device=None, dtype=None):
        super().__init__()
        for name, value in (("in_features", in_features), ("out_features", out_features)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"TiledLinear: {name}={value!r}; accepted: a positive int")
        self.in_features, self.out_features = in_features, out_features
        self.in_parts = _parts(in_features, in_splits, "in_splits")
        self.out_parts = _parts(out_features, out_splits, "out_splits")
        self.tiles = torch.nn.ModuleList(
            torch.nn.ModuleList(
                _Tile(i, o, bool(bias) and k == 0, in_features, device=device, dtype=dtype)
                for k, i in enumerate(self.in_parts))
            for o in self.out_parts)
        # Its state dict is the Linear's (weight and bias whole): the module's docstring.
        self._register_state_dict_hook(_whole_in_state_dict)
        self._register_load_state_dict_pre_hook(_cut_in_state_dict, with_module=True)

    def forward(self, x):
        xs = x.split(self.in_parts, dim=-1) if len(self.in_parts) > 1 else (x,)
        out = []
        for row in self.tiles:
            y = row[0](xs[0])
            for tile, xi in zip(row[1:], xs[1:]):
                y = y + tile(xi)
            out.append(y)
        return torch.cat(out, dim=-1) if len(out) > 1 else out[0]

    @classmethod
    def from_linear(cls, linear, in_splits=1, out_splits=1):
        """A TiledLinear with `linear`'s weights (and bias), on its device and dtype."""
        if not isinstance(linear, torch.nn.Linear):
            raise ValueError(f"TiledLinear.from_linear: {type(linear).__name__}; accepted: a "
                             "torch.nn.Linear")
        tiled = cls(linear.in_features, linear.out_features, bias=linear.bias is not None,
                    in_splits=in_splits, out_splits=out_splits, device=linear.weight.device,
                    dtype=linear.weight.dtype)
        _check_materialized(linear)
        with torch.no_grad():
            rows = linear.weight.split(tiled.out_parts, dim=0)
            biases = linear.bias.split(tiled.out_parts) if linear.bias is not None else None
            for o, row in enumerate(tiled.tiles):
                for tile, piece in zip(row, rows[o].split(tiled.in_parts, dim=1)):
                    tile.weight.copy_(piece)
                    tile.weight.requires_grad_(linear.weight.requires_grad)  # frozen stays so
                if biases is not None:
                    row[0].bias.copy_(biases[o])
                    row[0].bias.requires_grad_(linear.bias.requires_grad)
        tiled.train(linear.training)
        return tiled

    @property
    def weight(self):
        """The whole matrix, made from the tiles on each access (differentiable: gradients reach
        the tiles), for code that reads a Linear's weight (nn.TransformerEncoderLayer's fast path,
        F.linear(x, module.weight)); it costs the whole matrix in memory, which tiling avoids."""
        return self.weight_whole()

    @property
    def bias(self):
        """The whole bias (None without one), made on each access as ``weight`` is."""
        if self.tiles[0][0].bias is None:
            return None
        return torch.cat([row[0].bias for row in self.tiles])

    def weight_whole(self):
        """The (out_features, in_features) matrix the tiles make (a new tensor)."""
        return torch.cat([torch.cat([t.weight for t in row], dim=1) for row in self.tiles], dim=0)

    def extra_repr(self):
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"tiles={len(self.out_parts)}x{len(self.in_parts)}")


def _whole_in_state_dict(module, state_dict, prefix, local_metadata):
    """state_dict() post-hook: the tiles' entries made into the Linear's weight and bias, unless
    they are the parameters themselves (keep_vars=True)."""
    first = f"{prefix}tiles.0.0.weight"
    if first in state_dict and not isinstance(state_dict[first], torch.nn.Parameter):
        join_tiles(module, state_dict, prefix)


def join_tiles(module, state_dict, prefix=""):
    """`state_dict`'s entries of TiledLinear `module`'s tiles (under `prefix`) replaced by the
    whole weight and bias they make, in place."""
    if f"{prefix}tiles.0.0.weight" not in state_dict:
        return
    rows = range(len(module.out_parts))
    state_dict[prefix + "weight"] = torch.cat([torch.cat(
        [state_dict.pop(f"{prefix}tiles.{o}.{i}.weight") for i in range(len(module.in_parts))],
        dim=1) for o in rows], dim=0)
    if f"{prefix}tiles.0.0.bias" in state_dict:
        state_dict[prefix + "bias"] = torch.cat(
            [state_dict.pop(f"{prefix}tiles.{o}.0.bias") for o in rows])


def _cut_in_state_dict(module, state_dict, prefix, *unused):
    """load_state_dict pre-hook: a whole weight (and bias) cut into the tiles' entries."""
    cut_whole(module, state_dict, prefix)


def cut_whole(module, state_dict, prefix=""):
    """`state_dict`'s whole weight and bias of TiledLinear `module` (under `prefix`), when it
    holds them, replaced by its tiles' entries, in place."""
    weight = state_dict.pop(prefix + "weight", None)
    if weight is not None:
        for o, row in enumerate(weight.split(module.out_parts, dim=0)):
            for i, piece in enumerate(row.split(module.in_parts, dim=1)):
                state_dict[f"{prefix}tiles.{o}.{i}.weight"] = piece
    bias = state_dict.pop(prefix + "bias", None)
    if bias is not None:
        for o, piece in enumerate(bias.split(module.out_parts)):
            state_dict[f"{prefix}tiles.{o}.0.bias"] = piece


def _check_materialized(linear):
    """A Linear whose weights are not there to copy is refused: one built under strata.init (its
    parameters are placeholders; build the model with TiledLinear in that context instead) or on
    the meta device."""
    from strata import zero_init
    for p in (linear.weight, linear.bias):
        if p is None:
            continue
        if zero_init.partition_of(p) is not None or p.device.type == "meta":
            raise ValueError(
                "TiledLinear.from_linear: the Linear's weights are not materialized (built under "
                "strata.init, or on the meta device); accepted: a Linear with its weights, e.g. "
                "tile before strata.init, or build the model with strata.TiledLinear in the "
                "context")


def _splits_for(out_features, in_features, max_tile_params):
    """(in_splits, out_splits): the fewest tiles of at most max_tile_params weights, cutting the
    output features first (whole input rows keep the product exact) and the input features only
    when a single output row is too large."""
    if in_features <= max_tile_params:
        rows = max(1, max_tile_params // in_features)
        return 1, math.ceil(out_features / rows)
    return math.ceil(in_features / max_tile_params), out_features


def tile_linears(model, max_tile_params):
    """Replaces each torch.nn.Linear of `model` with more than `max_tile_params` weights by a
    TiledLinear of the same weights whose tiles have at most that many; returns how many were
    replaced. Call it before strata.initialize (on weights already loaded)."""
    if isinstance(max_tile_params, bool) or not isinstance(max_tile_params, int) or \
            max_tile_params < 1:
        raise ValueError(f"tile_linears: max_tile_params={max_tile_params!r}; accepted: a "
                         "positive int")
    # A weight tied to another module's (a language model's head and its embeddings) stays.
    seen, tied = set(), set()
    for _, p in model.named_parameters(remove_duplicate=False):
        (tied if id(p) in seen else seen).add(id(p))
    # Every Linear to replace is found (and checked) before any is: a refused model is unchanged.
    chosen = []
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear and child.weight.numel() > max_tile_params and \
                    id(child.weight) not in tied:
                if type(parent).__module__.split(".")[0] == "peft":
                    raise ValueError(
                        f"tile_linears: {name} belongs to {type(parent).__name__}, a peft adapter "
                        "layer, which reads its Linears' weights; accepted: tile the model before "
                        "applying peft, or a max_tile_params that leaves the adapted layers whole")
                _check_materialized(child)
                chosen.append((parent, name, child))
    for parent, name, child in chosen:
        in_splits, out_splits = _splits_for(child.out_features, child.in_features,
                                            max_tile_params)
        setattr(parent, name, TiledLinear.from_linear(child, in_splits, out_splits))
    replaced = len(chosen)
    return replaced
