"""The strategy's and the precision plugin's classes for one Lightning package (lightning.pytorch
or pytorch_lightning, whose base classes are distinct).

Part of strata.lightning (its module docstring says what the Trainer gets).
"""

import importlib
import importlib.util
import types


from strata.lightning.precision import _PrecisionMixin
from strata.lightning.strategy import _StrategyMixin


class _Flavor:
    """Lightning's pieces the strategy uses, from one package (lightning.pytorch or
    pytorch_lightning, whose classes are distinct)."""

    def __init__(self, package):
        pl = importlib.import_module(package)
        fabric = "lightning.fabric" if package == "lightning.pytorch" else "lightning_fabric"
        self.package = package
        self.pl = pl
        strategies = importlib.import_module(f"{package}.strategies")
        self.DDPStrategy = strategies.DDPStrategy
        self.StrategyRegistry = strategies.StrategyRegistry
        strategy_module = importlib.import_module(f"{package}.strategies.strategy")
        self.ForwardRedirection = strategy_module._ForwardRedirection
        self.Precision = importlib.import_module(f"{package}.plugins.precision").Precision
        self.TrainerFn = importlib.import_module(f"{package}.trainer.states").TrainerFn
        self.GradientAccumulationScheduler = importlib.import_module(
            f"{package}.callbacks").GradientAccumulationScheduler
        self.is_overridden = importlib.import_module(
            f"{package}.utilities.model_helpers").is_overridden
        optimizer = importlib.import_module(f"{package}.core.optimizer")
        self.init_optimizers = optimizer._init_optimizers_and_lr_schedulers
        self.MockOptimizer = optimizer._MockOptimizer
        self.LRSchedulerConfig = importlib.import_module(
            f"{package}.utilities.types").LRSchedulerConfig
        self.init_dist_connection = importlib.import_module(
            f"{fabric}.utilities.distributed")._init_dist_connection
        self.reset_seed = importlib.import_module(f"{fabric}.utilities.seed").reset_seed
        self.optimizers_to_device = importlib.import_module(
            f"{fabric}.utilities.optimizer")._optimizers_to_device
        flavor = self

        # Plain classes, on this package's base classes (named as strata.lightning's).
        class StrataPrecision(_PrecisionMixin, self.Precision):
            __doc__ = _PrecisionMixin.__doc__
            __module__ = "strata.lightning"
            __qualname__ = "StrataPrecision"

        class StrataStrategy(_StrategyMixin, self.DDPStrategy):
            __doc__ = _StrategyMixin.__doc__
            __module__ = "strata.lightning"
            __qualname__ = "StrataStrategy"
            _flavor = flavor

        self.StrataPrecision, self.StrataStrategy = StrataPrecision, StrataStrategy
        StrataStrategy.register_strategies(self.StrategyRegistry)


_FLAVORS = {}


def for_package(package="lightning.pytorch"):
    """The strata classes for one Lightning package ("lightning.pytorch" or
    "pytorch_lightning"): a namespace with StrataStrategy and StrataPrecision (the registered
    names are added to that package's registry)."""
    if package not in ("lightning.pytorch", "pytorch_lightning"):
        raise ValueError(f"strata.lightning.for_package: {package!r}; accepted: "
                         "'lightning.pytorch' or 'pytorch_lightning'")
    if package not in _FLAVORS:
        try:
            flavor = _Flavor(package)
        except ImportError as error:
            raise ImportError(f"strata.lightning: {package} is not installed ({error}); "
                              "python/requirements.txt pins lightning 2.6") from None
        _FLAVORS[package] = types.SimpleNamespace(StrataStrategy=flavor.StrataStrategy,
                                                  StrataPrecision=flavor.StrataPrecision,
                                                  flavor=flavor)
    return _FLAVORS[package]


def _primary():
    for package in ("lightning.pytorch", "pytorch_lightning"):
        if importlib.util.find_spec(package.split(".")[0]) is not None:
            try:
                return for_package(package)
            except ImportError:
                continue
    raise ImportError("strata.lightning needs Lightning 2.6 (lightning or pytorch_lightning); "
                      "python/requirements.txt pins it (scripts/python-env.sh installs it)")
