"""fp16's loss scale, by DeepSpeed's DynamicLossScaler rule (fp16.loss_scale 0: dynamic): an
overflow halves the scale (never under min_loss_scale) once `hysteresis` overflows have been
absorbed (an overflow at min_loss_scale raises, as DeepSpeed's); after loss_scale_window good
steps since the last overflow (or the start) the scale doubles, and again every
loss_scale_window good steps (DeepSpeed's rule since 0.17: a doubling one step later than its
older one's); with consecutive_hysteresis every good step restores the hysteresis, else only a
doubling does. A static scale (fp16.loss_scale above 0) never moves; bf16 and fp32 train at 1.0.

The engine owns one, multiplies each loss by `scale` and tells it each step's outcome (update);
its state goes into checkpoints (state_dict). Thread safety: the engine's (one thread).
"""

import torch

__all__ = ["LossScaler"]


class LossScaler:
    """The loss scale of one engine (see the module's docstring)."""

    def __init__(self, config, dtype):
        self._config = config  # strata/config.py TrainConfig: the fp16 block's keys
        self.scale = 1.0
        self.dynamic = False
        if dtype == torch.float16:
            self.dynamic = config.loss_scale == 0
            self.scale = 2.0 ** config.initial_scale_power if self.dynamic else config.loss_scale
        self._hysteresis_left = config.hysteresis
        self._iteration = 0
        self._last_overflow = -1

    def update(self, overflow):
        """A step's outcome: `overflow` (it was skipped) or not. Nothing moves a static scale."""
        if not self.dynamic:
            return
        c = self._config
        if overflow:
            if c.hysteresis == 1 or self._hysteresis_left == 1:
                if self.scale == c.min_loss_scale:  # DeepSpeed's DynamicLossScaler raises too
                    raise RuntimeError(
                        f"fp16: the gradients overflowed at the loss scale's minimum "
                        f"(fp16.min_loss_scale {c.min_loss_scale:g}): it cannot go lower, and "
                        "every step would be skipped; accepted: a lower min_loss_scale, or bf16")
                self.scale = max(self.scale / 2, c.min_loss_scale)
            else:
                self._hysteresis_left -= 1
            self._last_overflow = self._iteration
        else:
            if c.consecutive_hysteresis:
                self._hysteresis_left = c.hysteresis
            stable = self._iteration - self._last_overflow - 1  # good steps before this one
            if stable > 0 and stable % c.loss_scale_window == 0:
                if not c.consecutive_hysteresis:
                    self._hysteresis_left = c.hysteresis
                self.scale *= 2
        self._iteration += 1

    def state_dict(self):
        """What a checkpoint keeps (its "loss_scaler" entry)."""
        return {"loss_scale": self.scale, "hysteresis_left": self._hysteresis_left,
                "scale_iteration": self._iteration, "last_overflow": self._last_overflow}

    def load_state_dict(self, state):
        """state_dict()'s values taken back."""
        self.scale = state["loss_scale"]
        self._hysteresis_left = state["hysteresis_left"]
        self._iteration = state["scale_iteration"]
        self._last_overflow = state["last_overflow"]
