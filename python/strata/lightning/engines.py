"""The engines open here, each kept with the LightningModule whose weights it holds; their
weights whole (module_state_dict) or given back (release).

Part of strata.lightning (its module docstring says what the Trainer gets).
"""

import atexit
import weakref




class _Held:
    """What a LightningModule keeps of the engine that holds its weights (module.__dict__). A
    module held so is not copied or pickled: its weights are in the engine."""

    def __init__(self, engine, runtime_json):
        self.engine = engine
        self.runtime_json = runtime_json

    def __deepcopy__(self, memo):
        raise TypeError("a module trained by StrataStrategy keeps its weights in its strata "
                        "engine; accepted: strata.lightning.release(model) first (the weights "
                        "back in the module), or copy strata.lightning.module_state_dict(model)")

    def __reduce__(self):
        self.__deepcopy__(None)


_ENGINES = weakref.WeakSet()  # every engine made here, closed at exit (their swap files go)


@atexit.register
def _close_engines():
    for engine in list(_ENGINES):
        try:
            engine.close()
        except Exception:  # noqa: BLE001 - at exit, nothing is left to tell
            pass


def _closed(engine):
    try:
        engine.runtime  # noqa: B018 - a closed engine's raises
    except RuntimeError:
        return True
    return False


def _held(module):
    held = module.__dict__.get("_strata_engine") if module is not None else None
    if held is not None and _closed(held.engine):  # closed by its user
        module.__dict__.pop("_strata_engine", None)
        return None
    return held


def module_state_dict(model):
    """The module's state dict with every parameter whole (the engine's weights, in the training
    dtype, on the CPU), or model.state_dict() for a module no engine holds. Across ranks every
    rank must call it."""
    held = _held(model)
    return held.engine.module_state_dict() if held is not None else model.state_dict()


def release(model):
    """Puts the weights of the engine holding `model` back into the module's own parameters
    (plain tensors on the engine's device, in the training dtype; tied parameters stay tied) and
    closes the engine (its memory and swap files go). Across ranks every rank must call it.
    Returns the model. A module no engine holds is returned as it is."""
    held = _held(model)
    if held is None:
        return model
    held.engine.release()
    model.__dict__.pop("_strata_engine", None)
    return model
