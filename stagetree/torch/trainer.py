"""``TorchTrainer``: a :class:`~stagetree.trainer.Trainer` that checkpoints itself.

Write a subclass the way you would write a plain training loop::

    class MyTrainer(TorchTrainer):
        def __init__(self, config):
            super().__init__(config)            # first: it seeds the trainer's RNGs
            self.model = make_model(config)
            self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)
            self.loader = StageLoader((x, y), batch_size=32, seed=config["seed"])

        def train(self):
            self.model.train()
            x, y = self.loader.next_batch()
            loss = F.cross_entropy(self.model(x), y)
            self.optimizer.zero_grad()
            loss.backward()
            self.optimizer.step()
            return {"train_loss": loss.item()}

        def evaluate(self):
            return {"accuracy": accuracy(self.model, x_test, y_test)}

and ``state_dict`` / ``load_state_dict`` / ``setup`` / a trace-free ``evaluate`` come
for free. What :class:`TorchTrainer` adds, precisely:

**Checkpointed objects.** ``state_dict()`` scans ``vars(self)`` in sorted name order and
saves every attribute that has both ``state_dict`` and ``load_state_dict`` methods
(``torch.nn.Module``, ``torch.optim.Optimizer``, LR schedulers, ``GradScaler``,
:class:`StageLoader`, ...), every generator object (``torch.Generator``,
``numpy.random.Generator``/``RandomState``, ``random.Random``), and such objects inside a
list, tuple or dict attribute (saved as ``"name.0"`` / ``"name.key"``). An object held
by two attributes is saved once, under the first name. The train/eval mode of every
module and submodule is saved too. Set :attr:`TorchTrainer.checkpoint_attributes` to
checkpoint exactly the listed attributes instead, or
:attr:`TorchTrainer.checkpoint_exclude` to skip some. Anything else (plain numbers,
lists, counters) is *not* saved: return it from :meth:`TorchTrainer.extra_state` and put
it back in :meth:`TorchTrainer.load_extra_state`.

``state_dict()`` returns a snapshot (tensors are cloned), so a checkpoint can be written in
the background while training goes on. It holds tensors, numbers, strings, lists, tuples,
dicts and the ``None`` values PyTorch's own optimizer states contain, and loads with
``torch.load(weights_only=True)``. ``load_state_dict`` is strict: the restored trainer,
built from the same ``config``, must hold the same objects.

**The trainer's own RNG streams.** Inside the trainer's ``__init__``, ``setup``,
``train`` and ``evaluate`` (including subclass overrides, which are wrapped automatically
by ``__init_subclass__``) the process-global generators -- torch CPU, CUDA once in use,
numpy's ``np.random``, python's ``random`` -- are the trainer's own: seeded from
``config["seed"]`` (default 0) when construction starts, swapped in when one of these
methods is entered and swapped out (back to whatever the caller had) when it returns.
So code can call ``torch.rand``, ``np.random.normal`` and ``random.random`` freely, the
streams are part of the checkpoint, and neither other trainers in the same process nor the
worker's own code can shift them. Call ``super().__init__(config)`` first in ``__init__``;
draws that a subclass makes outside these methods use the caller's generators. Work in
``__init__`` that draws only on its first run in a process (a first import -- importing
scikit-learn draws from ``random`` --, a cache fill) would make construction depend on the
process's history: run it under :func:`~stagetree.torch.preserve_rng`.
Swapping costs about 0.1-0.3 ms per call of these methods on a CPU, nothing next to a
step of real training; in a worker process, where nobody else draws, only the trainer's
streams are swapped in (the caller's are not kept: see
:func:`stagetree.trainer.keep_caller_rng`), about half of that.

**A trace-free evaluate.** ``evaluate`` (any override; written naturally, without any
decorator) runs inside :meth:`TorchTrainer.no_trace`: under ``torch.no_grad()``, with every
module put in eval mode first (set :attr:`TorchTrainer.evaluate_in_eval_mode` to False to
keep the modes), and afterwards every RNG (global and object), every module's train/eval
mode and every :class:`StageLoader` position are put back exactly as they were. Use
``with self.no_trace():`` for other side computations (e.g. logging inside ``train``).

**Default setup.** ``setup(hp)`` merges ``hp`` into ``self.hp``, applies ``lr``,
``momentum``, ``weight_decay``, ``betas``/``beta1``/``beta2``, ``dampening``, ``eps`` and ``rho``
to every optimizer found (with :func:`~stagetree.torch.set_optimizer_hp`, which raises
``ValueError`` for a name an optimizer lacks, e.g. ``momentum`` on Adam) and
``batch_size`` to every :class:`StageLoader` found. Other names are only kept in
``self.hp``. Override it (calling ``super().setup(hp)``) for anything else.

**Accepted names.** :attr:`TorchTrainer.hyperparameters` lists the names the default
``setup`` applies; a trial with another name is rejected before anything is trained.
A subclass that uses more names (in ``self.hp`` or its own ``setup``) declares them:
``hyperparameters = TorchTrainer.hyperparameters | {"dropout"}``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import operator
from collections.abc import Callable, Iterator, Mapping
from typing import Any, ClassVar, TypeVar

import torch

from stagetree.exceptions import CheckpointError
from stagetree.torch.loader import StageLoader
from stagetree.torch.optim import OPTIMIZER_HP, set_optimizer_hp
from stagetree.torch.rng import (
    GlobalRngState,
    _cuda_in_use,
    capture_global_rng,
    decode_global_rng,
    encode_global_rng,
    get_rng_object_state,
    is_rng_object,
    preserve_rng,
    restore_global_rng,
    seed_rng,
    set_rng_object_state,
)
from stagetree.trainer import Trainer, building_to_restore, caller_rng_kept

__all__ = ["TorchTrainer"]

F = TypeVar("F", bound=Callable[..., Any])

STATE_FORMAT = 1
_PRIVATE = "_stagetree_"  # prefix of TorchTrainer's own attributes; never scanned
_RNG = "_stagetree_rng"
_DEPTH = "_stagetree_depth"
_WRAPPED = "__stagetree_wrapped__"
_MODULE_TRAIN = torch.nn.Module.train
_MODULE_SETATTR = torch.nn.Module.__setattr__


def _is_stateful(value: object) -> bool:
    return not isinstance(value, type) and (
        (
            callable(getattr(value, "state_dict", None))
            and callable(getattr(value, "load_state_dict", None))
        )
        or is_rng_object(value)
    )


def _clone_tree(value: Any) -> Any:
    """Copy of a state tree with every tensor cloned (containers rebuilt, leaves shared)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        copy = type(value)() if type(value) is not dict else {}
        try:
            for key, item in value.items():
                copy[key] = _clone_tree(item)
        except TypeError:  # a dict subclass that cannot be built empty
            copy = {key: _clone_tree(item) for key, item in value.items()}
        metadata = getattr(value, "_metadata", None)  # nn.Module state dict versions
        if metadata is not None:
            copy._metadata = metadata  # type: ignore[attr-defined]
        return copy
    if isinstance(value, list):
        return [_clone_tree(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_clone_tree(item) for item in value)
    return value


def _plain_module(module: torch.nn.Module) -> bool:
    """Whether ``module``'s ``train()`` and attribute setting are torch's own (so that
    setting its ``training`` flag directly is what ``eval()`` does)."""
    kind = type(module)
    return kind.train is _MODULE_TRAIN and kind.__setattr__ is _MODULE_SETATTR


def _set_modes(modules: list[torch.nn.Module], flags: list[bool]) -> None:
    """Set each module's ``training`` flag, only where it differs (``Module.__setattr__``
    is slow: written straight into the instance where torch's own would do that)."""
    for module, flag in zip(modules, flags):
        if module.training != flag:
            if _plain_module(module):
                module.__dict__["training"] = flag
            else:
                module.training = flag


def _seed_of(config: Any) -> int:
    seed = config.get("seed", 0) if isinstance(config, Mapping) else 0
    try:
        return operator.index(seed)
    except TypeError:
        raise ValueError(f"config['seed'] must be an integer, got {seed!r}") from None


# The in-place random fills (tensor methods and torch.nn.init functions) that a trainer
# built to be restored skips on its parameters: see TorchTrainer.restore_skips_init.
_RANDOM_FILLS = frozenset(
    {
        "bernoulli_",
        "cauchy_",
        "exponential_",
        "geometric_",
        "kaiming_normal_",
        "kaiming_uniform_",
        "log_normal_",
        "normal_",
        "orthogonal_",
        "random_",
        "sparse_",
        "trunc_normal_",
        "uniform_",
        "xavier_normal_",
        "xavier_uniform_",
    }
)


class _SkipParameterFills(torch.overrides.TorchFunctionMode):
    """Inside: a random fill of an ``nn.Parameter`` does nothing (and draws nothing)."""

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__name__", None) in _RANDOM_FILLS:
            target = args[0] if args else kwargs.get("tensor")
            if isinstance(target, torch.nn.Parameter):
                return target
        return func(*args, **kwargs)


def _in_rng_scope(fn: F) -> F:
    """Run ``fn`` with the trainer's RNG streams swapped in; keep what it draws."""

    @functools.wraps(fn)
    def wrapper(self: TorchTrainer, *args: Any, **kwargs: Any) -> Any:
        seed = None
        skip = False
        if fn.__name__ == "__init__" and _RNG not in self.__dict__:
            seed = _seed_of(args[0] if args else kwargs.get("config"))
            skip = (
                not self.__dict__.get(_DEPTH, 0)
                and type(self).restore_skips_init
                and building_to_restore()
            )
        with self._rng_scope(seed=seed):
            if skip:
                with _SkipParameterFills():
                    return fn(self, *args, **kwargs)
            return fn(self, *args, **kwargs)

    setattr(wrapper, _WRAPPED, True)
    return wrapper  # type: ignore[return-value]


def _without_trace(fn: F) -> F:
    """Run ``fn`` inside :meth:`TorchTrainer.no_trace`."""

    @functools.wraps(fn)
    def wrapper(self: TorchTrainer, *args: Any, **kwargs: Any) -> Any:
        with self.no_trace():
            return fn(self, *args, **kwargs)

    setattr(wrapper, _WRAPPED, True)
    return wrapper  # type: ignore[return-value]


_WRAPPERS: dict[str, Callable[[Any], Any]] = {
    "__init__": _in_rng_scope,
    "setup": _in_rng_scope,
    "train": _in_rng_scope,
    "evaluate": _without_trace,
}


class TorchTrainer(Trainer):
    """A :class:`~stagetree.trainer.Trainer` for PyTorch that checkpoints itself.

    See the module documentation of :mod:`stagetree.torch.trainer` for exactly what is
    checkpointed, how RNG streams are kept per trainer, how ``evaluate`` is made
    trace-free and what the default ``setup`` does.

    Attributes:
        hp: every sequential hyper-parameter value received by :meth:`setup` so far.
        checkpoint_attributes: class attribute; when not None, exactly these attribute
            names are checkpointed instead of the discovered ones.
        checkpoint_exclude: class attribute; attribute names never checkpointed.
        evaluate_in_eval_mode: class attribute; put every module in eval mode during
            ``evaluate`` (restored afterwards either way).
    """

    #: The names the default :meth:`setup` applies. Other names are rejected before
    #: anything is trained (a typo such as ``learning_rate`` would otherwise train with
    #: the default). A subclass that reads more names declares them, e.g.
    #: ``hyperparameters = TorchTrainer.hyperparameters | {"dropout"}``; one that
    #: overrides ``setup`` without declaring is unchecked (its reads are observed).
    hyperparameters: ClassVar[frozenset[str] | None] = OPTIMIZER_HP | {"batch_size"}
    checkpoint_attributes: ClassVar[tuple[str, ...] | None] = None
    checkpoint_exclude: ClassVar[tuple[str, ...]] = ()
    evaluate_in_eval_mode: ClassVar[bool] = True
    #: Modules that :meth:`warmup` imports and that a worker process may inherit from
    #: the fork server it is forked from (imported there once for all workers, before
    #: any starts, instead of once in each worker while the others start too). Only
    #: imports, and only of modules that are safe to fork after: none may leave a lock
    #: held by a thread it starts (scikit-learn's, whose BLAS and allocator threads
    #: handle forks, is). A subclass adds to it:
    #: ``warmup_imports = (*TorchTrainer.warmup_imports, "sklearn.datasets")``.
    warmup_imports: ClassVar[tuple[str, ...]] = ("torch._dynamo",)
    #: True in a subclass whose ``__init__`` draws random numbers only for the initial
    #: values of parameters it checkpoints (``torch.nn.init``'s fills, or a
    #: ``Tensor.uniform_``/``normal_``/... on an ``nn.Parameter``) and for objects it
    #: checkpoints (a :class:`StageLoader` seeded from the config): built to be
    #: restored from a checkpoint (:func:`stagetree.trainer.built_to_restore`, as a
    #: worker does), it skips those fills, which the restore overwrites (two thirds of
    #: building a small MLP). False by default: a later draw in ``__init__`` (a random
    #: split of the data, a random buffer that is not checkpointed) would see other
    #: numbers with the fills skipped, and the restored trainer would not be exact.
    restore_skips_init: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for name, wrap in _WRAPPERS.items():
            fn = cls.__dict__.get(name)
            if callable(fn) and not getattr(fn, _WRAPPED, False):
                setattr(cls, name, wrap(fn))

    @_in_rng_scope
    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__(config)
        self.hp: dict[str, Any] = {}

    @classmethod
    def warmup(cls) -> None:
        """Import what the first optimizer built in a process imports: a
        ``torch.optim`` optimizer's first construction imports ``torch._dynamo``
        (seconds), which a worker's first batch would otherwise spend building its
        trainer (and report as its load time). Every RNG is left as it was. A subclass
        that overrides this calls ``super().warmup()``."""
        with preserve_rng(), contextlib.suppress(ImportError):
            importlib.import_module("torch._dynamo")

    # -- RNG streams ------------------------------------------------------------------------

    @contextlib.contextmanager
    def _rng_scope(self, seed: int | None = None) -> Iterator[None]:
        state = self.__dict__
        depth = state.get(_DEPTH, 0)
        outer: GlobalRngState | None = None
        if depth == 0:
            # The caller's streams, unless nobody outside the trainers draws (a worker).
            outer = capture_global_rng() if caller_rng_kept() else None
            if seed is not None:
                seed_rng(seed)
            elif _RNG in state:
                restore_global_rng(state[_RNG])
            else:  # constructed without TorchTrainer.__init__: start from seed 0
                seed_rng(0)
        state[_DEPTH] = depth + 1
        try:
            yield
        finally:
            state[_DEPTH] = depth
            if depth == 0:
                state[_RNG] = capture_global_rng()
                if outer is not None:
                    restore_global_rng(outer)

    def _current_rng(self) -> GlobalRngState:
        if self.__dict__.get(_DEPTH, 0) > 0:
            return capture_global_rng()
        state = self.__dict__.get(_RNG)
        if state is None:
            raise CheckpointError(
                f"{type(self).__name__} has no RNG state: was TorchTrainer.__init__ called?"
            )
        return state

    @contextlib.contextmanager
    def no_trace(self) -> Iterator[None]:
        """Run a block that leaves no trace on training.

        Inside: the trainer's RNG streams, ``torch.no_grad()``, every module in eval mode
        (unless :attr:`evaluate_in_eval_mode` is False). Afterwards every global and
        object RNG, every module's train/eval mode and every :class:`StageLoader` cursor
        is exactly as before the block.
        """
        state = self.__dict__
        saved = state.get(_RNG)
        if state.get(_DEPTH, 0) or saved is None or bool(saved.cuda) != _cuda_in_use():
            with self._rng_scope(), self._untraced(capture_global_rng()):
                yield
            return
        # Called from outside the trainer (the worker evaluating): its streams are the
        # stored ones, and the block leaves them as they were, so they are put in and
        # the caller's back, without capturing them again or restoring them before the
        # caller's (which sets every generator they hold): 2 of 3 captures and 1 of 3
        # restores saved; an evaluation is often a step's largest cost after training.
        # Where nobody outside the trainers draws (a worker process), the caller's are
        # neither captured nor put back: one restore in all.
        outer = capture_global_rng() if caller_rng_kept() else None
        restore_global_rng(saved)
        state[_DEPTH] = 1
        try:
            with self._untraced(None):
                yield
        finally:
            state[_DEPTH] = 0
            if bool(saved.cuda) != _cuda_in_use():  # CUDA came up inside: as _rng_scope
                restore_global_rng(saved)
                state[_RNG] = capture_global_rng()
            if outer is not None:
                restore_global_rng(outer)

    @contextlib.contextmanager
    def _untraced(self, rng: GlobalRngState | None) -> Iterator[None]:
        """The body of :meth:`no_trace`: eval mode and no_grad inside; afterwards modes,
        loader cursors, object RNGs and the global generators (to ``rng``, unless None:
        the caller restores them) put back."""
        objects = self.checkpointed_objects()
        rng_objects = {
            name: get_rng_object_state(obj) for name, obj in objects.items() if is_rng_object(obj)
        }
        loaders = {
            name: obj.state_dict() for name, obj in objects.items() if isinstance(obj, StageLoader)
        }
        modules = [obj for obj in objects.values() if isinstance(obj, torch.nn.Module)]
        subs = [list(module.modules()) for module in modules]
        modes = [[m.training for m in group] for group in subs]
        try:
            if self.evaluate_in_eval_mode:
                for module, group in zip(modules, subs):
                    if all(map(_plain_module, group)):
                        _set_modes(group, [False] * len(group))  # as eval(), faster
                    else:
                        module.eval()
            with torch.no_grad():
                yield
        finally:
            for group, flags in zip(subs, modes):
                _set_modes(group, flags)
            for name, loader_state in loaders.items():
                objects[name].load_state_dict(loader_state)
            for name, rng_state in rng_objects.items():
                set_rng_object_state(objects[name], rng_state)
            if rng is not None:
                restore_global_rng(rng)

    # -- discovery --------------------------------------------------------------------------

    def checkpointed_objects(self) -> dict[str, Any]:
        """Attribute name -> object that :meth:`state_dict` saves, in sorted name order.

        Raises:
            CheckpointError: a name in :attr:`checkpoint_attributes` is missing or holds
                nothing that can be checkpointed.
        """
        found: dict[str, Any] = {}
        seen: set[int] = set()

        def add(name: str, value: Any) -> bool:
            if not _is_stateful(value):
                return False
            if id(value) not in seen:
                seen.add(id(value))
                found[name] = value
            return True

        def add_attribute(name: str, value: Any) -> bool:
            if add(name, value):
                return True
            items: list[tuple[str, Any]] = []
            if isinstance(value, (list, tuple)):
                items = [(str(i), v) for i, v in enumerate(value)]
            elif isinstance(value, dict) and all(isinstance(k, str) for k in value):
                items = sorted(value.items())
            if not items or not all(_is_stateful(v) for _, v in items):
                return False
            for key, item in items:
                add(f"{name}.{key}", item)
            return True

        attributes = vars(self)
        if self.checkpoint_attributes is not None:
            for name in self.checkpoint_attributes:
                if name not in attributes:
                    raise CheckpointError(
                        f"checkpoint_attributes names {name!r}, which "
                        f"{type(self).__name__} does not have"
                    )
                if not add_attribute(name, attributes[name]):
                    raise CheckpointError(
                        f"attribute {name!r} of {type(self).__name__} holds nothing with "
                        "state_dict/load_state_dict or RNG state"
                    )
            return found
        for name in sorted(attributes):
            if name.startswith(_PRIVATE) or name in self.checkpoint_exclude:
                continue
            add_attribute(name, attributes[name])
        return found

    def _optimizers(self) -> list[torch.optim.Optimizer]:
        return [
            obj
            for obj in self.checkpointed_objects().values()
            if isinstance(obj, torch.optim.Optimizer)
        ]

    def _loaders(self) -> list[StageLoader]:
        return [obj for obj in self.checkpointed_objects().values() if isinstance(obj, StageLoader)]

    # -- contract ---------------------------------------------------------------------------

    @_in_rng_scope
    def setup(self, hp: Mapping[str, Any]) -> None:
        """Keep ``hp`` in ``self.hp``; apply optimizer values and ``batch_size``.

        Raises:
            ValueError: an optimizer lacks one of the given optimizer hyper-parameters, or a
                value is invalid.
        """
        self.__dict__.setdefault("hp", {}).update(hp)
        optimizer_values = {name: value for name, value in hp.items() if name in OPTIMIZER_HP}
        if optimizer_values:
            for optimizer in self._optimizers():
                set_optimizer_hp(optimizer, **optimizer_values)
        if "batch_size" in hp:
            for loader in self._loaders():
                loader.set_batch_size(hp["batch_size"])

    def extra_state(self) -> dict[str, Any]:
        """State not held by checkpointed objects (counters, histories); {} by default.

        It must be made of tensors, numbers, strings, lists, tuples and dicts.
        """
        return {}

    def load_extra_state(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`extra_state` returned."""

    def state_dict(self) -> dict[str, Any]:
        """A snapshot of everything that shapes future training (see the module docs)."""
        objects: dict[str, Any] = {}
        rng_objects: dict[str, Any] = {}
        modes: dict[str, list[bool]] = {}
        for name, obj in self.checkpointed_objects().items():
            if is_rng_object(obj):
                rng_objects[name] = get_rng_object_state(obj)
                continue
            objects[name] = _clone_tree(obj.state_dict())
            if isinstance(obj, torch.nn.Module):
                modes[name] = [m.training for m in obj.modules()]
        return {
            "format": STATE_FORMAT,
            "objects": objects,
            "rng_objects": rng_objects,
            "modes": modes,
            "rng": encode_global_rng(self._current_rng()),
            "extra": _clone_tree(self.extra_state()),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict` into a trainer built with the same config.

        Raises:
            CheckpointError: the state has another format, or names objects this trainer
                does not hold (or misses some it holds).
        """
        if state.get("format") != STATE_FORMAT:
            raise CheckpointError(
                f"unknown TorchTrainer state format {state.get('format')!r} "
                f"(expected {STATE_FORMAT})"
            )
        current = self.checkpointed_objects()
        saved = set(state["objects"]) | set(state["rng_objects"])
        if saved != set(current):
            missing = sorted(set(current) - saved)
            unexpected = sorted(saved - set(current))
            raise CheckpointError(
                f"checkpoint does not fit {type(self).__name__}: missing {missing}, "
                f"unexpected {unexpected}"
            )
        for name, obj_state in state["objects"].items():
            obj = current[name]
            if isinstance(obj, torch.nn.Module):
                obj.load_state_dict(obj_state)  # copies into the parameters
                for submodule, flag in zip(obj.modules(), state["modes"].get(name, [])):
                    submodule.training = bool(flag)
            else:
                # Optimizers keep the tensors they are given: clone so that two trainers
                # restored from one in-memory state never share buffers.
                obj.load_state_dict(_clone_tree(obj_state))
        for name, rng_state in state["rng_objects"].items():
            set_rng_object_state(current[name], rng_state)
        rng = decode_global_rng(state["rng"])
        if self.__dict__.get(_DEPTH, 0) > 0:
            restore_global_rng(rng)
        else:
            self.__dict__[_RNG] = rng
        self.load_extra_state(_clone_tree(state["extra"]))
