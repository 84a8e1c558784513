"""Lightning's checkpoint inside strata's checkpoint folder, and the collation of a folder into
one fp32 state dict.

Part of strata.lightning (its module docstring says what the Trainer gets).
"""

import io
import os

import torch

from strata import checkpoints as _checkpoints

# The tag strata's checkpoint folder holds Lightning's checkpoint under (DeepSpeedStrategy's).
TAG = "checkpoint"
# The key of Lightning's own state in the engine's client_state (packed: see _pack).
_CLIENT_KEY = "lightning"


def _pack(checkpoint):
    """Lightning's checkpoint dict as bytes in a tensor: the engine's engine_states.pt keeps it
    whatever objects it holds, and it is read back by Lightning's own rules (_unpack)."""
    buffer = io.BytesIO()
    torch.save(checkpoint, buffer)
    return {_CLIENT_KEY: torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)}


def _unpack(client_state, where, weights_only=None):
    if not isinstance(client_state, dict) or _CLIENT_KEY not in client_state:
        raise ValueError(f"StrataStrategy: {where} is a strata checkpoint that a Trainer did not "
                         "save (no Lightning state in it); accepted: a folder saved by "
                         "StrataStrategy (trainer.save_checkpoint, ModelCheckpoint), or "
                         "engine.load_checkpoint for the engine's own")
    data = client_state[_CLIENT_KEY].numpy().tobytes()
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=weights_only)


def _checkpoint_folder(path):
    """The checkpoint's folder and tag: `path` may be the save folder (with `latest`) or a tag's
    folder in it."""
    path = os.fspath(path)
    if os.path.isfile(os.path.join(path, _checkpoints.LATEST)):
        return path, None
    if os.path.isfile(os.path.join(path, _checkpoints.META)):
        return os.path.dirname(os.path.abspath(path)), os.path.basename(os.path.abspath(path))
    return None, None


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir, output_file, tag=None,
                                               weights_only=False):
    """Collates a strata checkpoint folder saved by the Trainer (``epoch=0-step=10.ckpt/``) into
    one file, as Lightning's utility of the same name: Lightning's checkpoint (hyper-parameters,
    loops, callbacks, ...) with ``state_dict`` the model's fp32 weights (the optimizer's master
    weights; buffers and frozen parameters as saved), written by torch.save.
    ``LightningModule.load_from_checkpoint(output_file)`` reads it, and
    ``StrataStrategy(load_full_weights=True)`` takes its weights. The optimizer's state is not in
    it: keep the folder to resume training. Every digest is verified first (a damaged file is
    named, nothing is written). Returns the file's checkpoint dict."""
    from strata import zero_to_fp32
    folder, found_tag = _checkpoint_folder(checkpoint_dir)
    if folder is None:
        raise _checkpoints.CheckpointError(
            f"convert_zero_checkpoint_to_fp32_state_dict: {os.fspath(checkpoint_dir)} is not a "
            "strata checkpoint folder (no `latest`, no meta.json); accepted: the folder "
            "trainer.save_checkpoint or ModelCheckpoint wrote")
    path, state = zero_to_fp32._state_dict(folder, tag if tag is not None else found_tag)
    state = zero_to_fp32._materialize(state)
    client = torch.load(os.path.join(path, _checkpoints.ENGINE))["client_state"]
    checkpoint = _unpack(client, path, weights_only=weights_only)
    checkpoint["state_dict"] = {name: t.clone() for name, t in state.items()}
    for key in ("optimizer_states",):
        checkpoint.pop(key, None)
    output_file = os.fspath(output_file)
    parent = os.path.dirname(os.path.abspath(output_file))
    os.makedirs(parent, exist_ok=True)
    torch.save(checkpoint, output_file)
    return checkpoint
