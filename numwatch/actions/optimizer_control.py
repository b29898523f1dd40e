"""The optimizer as actions see it: a wrapper around ``optimizer.step`` installed on demand.

Installed only when a configured action needs it (skip_step, lr_backoff, qk_clip; halt, for an
optimizer not of torch.optim's own, whose step may move its parameters before calling its
closure, where a halt is decided: SAM's ascent, put back before the halt stops training). It
replaces the instance attribute ``optimizer.step`` with a bound method, as the class's own step
is: an LR scheduler built after us wraps ``optimizer.step.__func__``. ``uninstall`` restores what
was there (the class's method, or a wrapper a user or an LR scheduler had installed before us)
unless something wrapped ours after us, in which case ours stays as a pass-through: it keeps
nothing of the monitor once it needs nothing more (a skip kept for the step under way taken).
Another monitor's wrapper over ours takes it along when it goes (two monitors on one
optimizer, detached in attach order); an LR scheduler's cannot.

Accelerate's ``AcceleratedOptimizer`` with a GradScaler (fp16) does not call ``optimizer.step``:
each of its steps sets it to a patched copy of the method it saved at prepare, then back to that
method, which drops a wrapper installed on the optimizer. Given that wrapper, ours goes in as
the method it saved (and in its patched copy), and ``uninstall`` puts back what it had. Given
the optimizer inside it instead, a step pre-hook sees the first update that runs without ours,
finds the wrapper whose step runs it up the call stack, and does the same from there.

A step we withhold reads as skipped in that wrapper's ``step_was_skipped``, as its GradScaler's
overflow skips do, so Accelerate's ``AcceleratedScheduler`` and the Hugging Face Trainer keep the
LR schedule where it was. With a GradScaler its step() derives that from whether the step method
it saved was called: ours, skipping, says it was not. Without one nothing else sets the flag it
reads: ours sets it for a skip and clears it at the next step (and at uninstall, so a skip that
ends with a detach, as a halt's, is not shown: nothing would clear it later).
"""

from __future__ import annotations

import copy
import inspect
import logging
import sys
import types
from collections.abc import Callable, Hashable
from functools import partial
from operator import attrgetter
from typing import Any

import torch

from numwatch.distributed import local_tensor
from numwatch.errors import NumwatchError
from numwatch.hooks import UserHook, remove_step_pre_hook, running_step_pre_hook
from numwatch.probes.optimizer import numeric_lr

__all__ = ["OptimizerControl", "clear_gradients", "moves_before_closure"]

log = logging.getLogger("numwatch")

_VERSION = attrgetter("_version")
# Parameters whose versions and values tell whether an optimizer taken for one that calls its
# closure first changed its parameters before calling it: a few, spread over those that train
# (SAM's ascent step changes every one of them). Reading every parameter's version cost
# 0.1-0.2 ms per step with 1000 parameters.
_WATCHED = 4
# The integer dtype a parameter's elements are read as for its checksum, by element size
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_INTEGERS = frozenset(_BITS.values())


class OptimizerControl:
    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        before_step: Callable[[torch.Tensor | None], None],
        run_guarded: Callable[[Callable[[], None]], Any] = lambda fn: fn(),
        accelerated: Any = None,
        skips: bool = True,
        judge_again: Callable[[Any], None] = lambda loss: None,
        halts: bool = False,
    ) -> None:
        """``accelerated``: Accelerate's ``AcceleratedOptimizer`` around ``optimizer``, whose
        steps run it (see the module docstring). ``skips``: a skip_step rule is configured (a
        step may be withheld; only then, or with ``halts``, does a closure step watch or copy the
        parameters).
        ``judge_again(loss)``: judges a later call of the closure in the same step (its
        gradients are in ``.grad``), which may decide a skip. ``halts``: a halt rule is configured
        (a step may end in its closure too, so closure steps watch and copy as for a skip)."""
        self.optimizer = optimizer
        # the monitor's guard (failures counted, not raised); None, as _before_step, once released
        self._run_guarded: Callable[[Callable[[], None]], Any] | None = run_guarded
        self.active = True
        self.skipped_steps = 0
        self.skips_decided = 0  # skip_current_step() calls: other optimizers of a step follow
        self._before_step: Callable[[torch.Tensor | None], None] | None = before_step
        self._original = optimizer.step
        self._instance_step = optimizer.__dict__.get("step")  # a wrapper installed before us
        self._skip = False
        self._backoffs: list[tuple[float, int, Hashable]] = []  # (factor, steps left, key)
        self._after_step: dict[Hashable, Callable[[], None]] = {}
        self._stepping = False  # inside the wrapped step (it runs _after_step after the update)
        # (group, the schedule's LR, the LR we set, its version): undone after the update
        self._scaled: list[tuple[dict[str, Any], Any, Any, int | None]] = []
        # Closure steps. torch.optim's own optimizers call the closure once, before changing
        # anything; another one may change its parameters before a call (SAM's ascent) or call
        # it again after moving them (LBFGS): learned from its steps (None: none seen yet; True
        # once seen, for good), and while not known to be False, each of its steps copies the
        # parameters first so that a skip decided at any call can put them back.
        self._skips = skips
        self._judge_again: Callable[[Any], None] | None = judge_again
        self._evaluates_first = not (skips or halts) or _evaluates_first(optimizer)
        self._moves_first: bool | None = None
        self._in_place: set[Hashable] = set()  # state keys changed in place before a call
        self._watched: tuple[tuple[tuple[int, int], ...], list[torch.Tensor]] = ((), [])

        def step(_optimizer: Any, *args: Any, **kwargs: Any) -> Any:
            return self._step(*args, **kwargs)

        # The step's own signature: GradScaler passes itself (grad_scaler=) only to a step whose
        # signature names it (the _step_supports_amp_scaling contract).
        try:
            signature = inspect.signature(self._original)
            bound = inspect.Parameter("_optimizer", inspect.Parameter.POSITIONAL_ONLY)
            params = [bound, *signature.parameters.values()]
            step.__signature__ = signature.replace(parameters=params)  # type: ignore[attr-defined]
        except (TypeError, ValueError):  # none to read: (*args, **kwargs) passes everything on
            pass

        # An LR scheduler built earlier marks the step it wrapped; keep the mark so it does not
        # warn that optimizer.step() was overridden after it.
        if getattr(self._original, "_wrapped_by_lr_sched", False):
            step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
        step._numwatch_control = self  # type: ignore[attr-defined]  # see _pass_through
        self._wrapper = types.MethodType(step, optimizer)
        optimizer.step = self._wrapper  # type: ignore[method-assign]
        # (AcceleratedOptimizer, the step method it saved, its patched copy) before ours
        self._accelerate: tuple[Any, Any, Any] | None = None
        self._accelerated: Any = None  # Accelerate's wrapper whose steps run ours, once known
        self._skip_flag: str | None = None  # what shows our skip in its step_was_skipped
        self._shown = False  # _is_overflow set for our skip: cleared at the next step
        if type(accelerated).__module__.startswith("accelerate."):  # (not another library's)
            self._show_skips_in(accelerated)
            if getattr(accelerated, "scaler", None) is not None:
                self._into_accelerate(accelerated)
        self._told_unwrapped = False  # _unwrapped_step's warning: once
        self._unwrapped_hook = optimizer.register_step_pre_hook(
            UserHook(running_step_pre_hook(self._unwrapped_step))
        )

    def _into_accelerate(self, accelerated: Any) -> bool:
        """Ours as the step method an AcceleratedOptimizer with a GradScaler saved at prepare
        (private attributes of Accelerate: checked, and a warning if they are not found).
        Whether its steps run ours now."""
        try:
            from accelerate.optimizer import patch_optimizer_step

            original = accelerated._optimizer_original_step_method
            patched = accelerated._optimizer_patched_step_method
        except (ImportError, AttributeError):
            log.warning(
                "numwatch: %s with a GradScaler: this accelerate version does not keep the "
                "step method it runs in _optimizer_original_step_method and "
                "_optimizer_patched_step_method, so skip_step, lr_backoff and qk_clip cannot "
                "act on its steps: they do nothing there",
                type(accelerated).__name__,
            )
            return False
        accelerated._optimizer_original_step_method = self._wrapper
        accelerated._optimizer_patched_step_method = patch_optimizer_step(
            accelerated, self._wrapper
        )
        self._accelerate = (accelerated, original, patched)
        return True

    def _unwrapped_step(self, optimizer: Any, args: tuple, kwargs: dict) -> None:
        """Step pre-hook: an update runs without our wrapper. Accelerate's AcceleratedOptimizer
        with a GradScaler does that when attach() was given the optimizer inside it (it calls the
        step method it saved at prepare): ours goes in there, so its later steps run ours, and
        this one is closed and withheld here as ours would (a skip clears the gradients, so the
        optimizer updates nothing; a back-off or clip decided for it starts with the next
        update). Any other caller's steps are out of reach: said once."""
        if self._stepping or not self.active or self._told_unwrapped:
            return
        accelerated = _running_accelerated(optimizer)
        if self._accelerate is None and getattr(accelerated, "scaler", None) is not None:
            if self._accelerated is None:
                self._show_skips_in(accelerated)
            if self._into_accelerate(accelerated):
                self._during_step(self._close_unwrapped)
            else:  # (it said why)
                self._told_unwrapped = True
        else:
            self._told_unwrapped = True
            log.warning(
                "numwatch: %s.step() ran without numwatch's step wrapper (called through a step "
                "method taken from the optimizer before attach()), so skip_step, lr_backoff and "
                "qk_clip cannot act on its updates; attach() before that method is taken",
                type(optimizer).__name__,
            )

    def _show_skips_in(self, accelerated: Any) -> None:
        """Our skips show in ``accelerated.step_was_skipped`` from now on (private attributes of
        Accelerate: checked, and a warning if they are not the ones known)."""
        self._accelerated = accelerated
        self._skip_flag = _skip_flag(accelerated)
        if self._skip_flag is None:
            log.warning(
                "numwatch: %s.step_was_skipped in this accelerate version is not read from the "
                "attributes numwatch sets (_is_overflow, _accelerate_step_called), so an update "
                "skip_step withholds reads as not skipped there: an LR schedule that Accelerate "
                "or the Trainer steps advances on it",
                type(accelerated).__name__,
            )

    def _show_skip(self) -> None:
        """This step reads as skipped in the ``step_was_skipped`` of Accelerate's wrapper whose
        step runs ours (found up the stack the first time: attach() given its optimizer)."""
        if self._accelerated is None:
            accelerated = _running_accelerated(self.optimizer)
            if accelerated is None:
                return
            self._show_skips_in(accelerated)
        if self._skip_flag == "_accelerate_step_called":  # its step reads it after ours
            self._accelerated._accelerate_step_called = False
        elif self._skip_flag == "_is_overflow":
            self._accelerated._is_overflow = self._shown = True

    def _unshow_skip(self) -> None:
        """Clear a skip shown by ``_is_overflow`` (no GradScaler): nothing else ever would."""
        if self._shown:
            self._accelerated._is_overflow = self._shown = False

    def _close_unwrapped(self) -> None:
        """What our wrapper does before an update without a closure, in the update's pre-hook."""
        self._before_step(None)
        if self._skip:
            self._skip_now(None)

    # -------------------------------------------------------------- requests from actions
    def skip_current_step(self) -> None:
        """This step's optimizer.step() does nothing and clears the gradients."""
        self._skip = True
        self.skips_decided += 1

    def new_step(self) -> None:
        """A skip decision belongs to the step it judged: if that step's optimizer.step() never
        ran (a GradScaler skips overflow steps itself), it must not skip the next one."""
        self._skip = False

    def back_off_lr(self, factor: float, steps: int, key: Hashable = None) -> None:
        """Multiply every group's LR by ``factor`` for the next ``steps`` optimizer steps. A
        ``key`` replaces its own back-off still running (the window restarts, the factor does
        not compound); back-offs without one compound."""
        if key is not None:
            self._backoffs = [b for b in self._backoffs if b[2] != key]
        self._backoffs.append((factor, steps, key))

    def after_next_step(self, fn: Callable[[], None], key: Hashable | None = None) -> None:
        """Run ``fn`` right after the next optimizer update (e.g. QK-clip), under the monitor's
        guard: its failure is counted, never raised from optimizer.step(). A pending function
        of the same ``key`` is replaced."""
        self._after_step[object() if key is None else key] = fn

    @property
    def lr_factor(self) -> float:
        factor = 1.0
        for f, _, _ in self._backoffs:
            factor *= f
        return factor

    # -------------------------------------------------------------- the wrapped step
    def _step(self, *args: Any, **kwargs: Any) -> Any:
        return self._during_step(self._wrapped_step, *args, **kwargs)

    def _during_step(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        self._stepping = True
        self._unshow_skip()  # the previous step's
        try:
            return fn(*args, **kwargs)
        finally:
            self._stepping = False
            if not self.active and not self._skip:  # uninstalled during it, or a kept skip taken
                self._run_pending()  # (no later update will run them: a detach during this step)
                self._release()

    def _wrapped_step(self, *args: Any, **kwargs: Any) -> Any:
        closure = kwargs.get("closure", args[0] if args else None)
        scaler = kwargs.get("grad_scaler")
        if not self.active:
            if self._skip:  # the skip decided before an uninstall (a halt) holds for its step
                return self._skip_now(closure, scaler=scaler)
            return self._original(*args, **kwargs)
        if closure is None:
            self._before_step(None)
            if self._skip:  # (a back-off counts the updates that run at its LR)
                return self._skip_now(None, scaler=scaler)
        judging = None
        if closure is not None:
            judging = self._judging(closure)
            if "closure" in kwargs:
                kwargs = {**kwargs, "closure": judging}
            else:
                args = (judging, *args[1:])
        self._scale_lrs()
        try:
            out = self._original(*args, **kwargs)
            if judging is not None and judging.calls and self._moves_first is None:
                # (the first closure step) SYNC: once, where no version showed a move
                self._moves_first = judging.calls > 1 or judging.moved or judging.moved_unseen()
        except _Withheld as withheld:
            if withheld.control is not self:  # another monitor's wrapper, around ours
                raise
            return self._skip_now(None, withheld.loss, scaler)
        finally:
            self._restore_lrs()
        # A fused optimizer under a GradScaler is called on an overflow step too and skips the
        # update itself: that step neither counts for a back-off nor runs a clip.
        if (self._backoffs or self._after_step) and not _skipped_by_scaler(self.optimizer):
            self._tick()
            self._run_pending()
        return out

    def _judging(self, closure: Callable[[], Any]) -> _Judging:
        """``closure``, judging the step after its first call, as the optimizer makes it: that
        call makes the step's gradients (LBFGS's later ones probe other points; SAM's first
        comes after its ascent step, at the perturbed weights). Evaluated before the step
        instead, it was one more backward, and SAM's own call got that cached loss and no
        gradients, so its second step never restored the weights. Later calls are judged by
        ``judge_again``: the update uses their gradients too (SAM's at the perturbed weights).
        A skip ends the step from the call that decided it, before the update, with the
        parameters and state the step began with."""
        snapshot = watched = None
        if not self._evaluates_first:
            if self._moves_first is not True:  # (learning it, or taken for False)
                watched = self._watched_params()
            if self._moves_first is not False:
                snapshot = self._run_guarded(lambda: _Snapshot(self.optimizer, self._in_place))
        return _Judging(self, closure, snapshot, watched)

    def _judged(self, judging: _Judging, loss: Any) -> None:
        """The closure's call ``judging.calls`` returned ``loss``: judge it; a skip ends the
        step here. So does a halt decided here (or a strict monitor's error), raised through
        the optimizer's step: the parameters are put back first, or SAM's would stay at its
        perturbed point when training stops."""
        try:
            if judging.calls == 1:
                self._before_step(loss if isinstance(loss, torch.Tensor) else None)
            elif self._skips and self.active and self._judge_again is not None:
                self._judge_again(loss)
        except Exception:
            self._put_back(judging)
            raise
        if self._skip:
            self._put_back(judging)
            raise _Withheld(self, loss)
        if judging.calls == 1:
            self._scale_lrs()  # a back-off decided on this step slows its update

    def _put_back(self, judging: _Judging) -> None:
        """The parameters and state as the step began, for a step ended in its closure: from
        the step's copy; where none was taken and the optimizer moved them, they stay as they
        are, counted as an error (its steps are copied from then on)."""
        if judging.snapshot is not None:
            self._run_guarded(partial(judging.snapshot.restore, self.optimizer))
        elif judging.moved or judging.moved_unseen():
            self._moves_first = True
            self._run_guarded(_cannot_restore)

    def _watched_params(self) -> list[torch.Tensor]:
        """A few of the optimizer's parameters that train, spread over them; chosen again when
        its param groups change (add_param_group)."""
        groups = self.optimizer.param_groups
        key = tuple((id(g["params"]), len(g["params"])) for g in groups)
        if key != self._watched[0]:
            params = [p for g in groups for p in g["params"] if p.requires_grad]
            n = len(params)
            picked = sorted({i * (n - 1) // (_WATCHED - 1) for i in range(_WATCHED)}) if n else []
            self._watched = (key, [params[i] for i in picked])
        return self._watched[1]

    def _scale_lrs(self) -> None:
        """Each numeric LR times the back-offs' factor, for the update under way (None: the
        optimizer computes its step size); again from the schedule's LR when called twice."""
        self._restore_lrs()
        factor = self.lr_factor
        if factor == 1.0:
            return
        for group in self.optimizer.param_groups:
            lr = group["lr"]
            if numeric_lr(lr):
                group["lr"] = ours = lr * factor
                self._scaled.append((group, lr, ours, getattr(ours, "_version", None)))

    def _restore_lrs(self) -> None:
        """The schedule never sees our factor, so the back-off composes with any LR scheduler:
        an LR still the one we set gets the schedule's back; one changed during the step (a
        scheduler stepped from a step post-hook, in place for a tensor LR) is the schedule's."""
        scaled, self._scaled = self._scaled, []
        for group, lr, ours, version in scaled:
            if group["lr"] is ours and getattr(ours, "_version", None) == version:
                group["lr"] = lr

    def _skip_now(
        self, closure: Callable[[], Any] | None, loss: Any = None, scaler: Any = None
    ) -> Any:
        """This step's update does not happen: its gradients (the closure's, when it has not run
        yet: a framework's step computes them in it) are cleared instead. ``scaler``: the
        GradScaler handed to the step (``grad_scaler=``), which expects the step to unscale
        (its update() needs the inf check that records)."""
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if scaler is not None:
            _unscale_once(scaler, self.optimizer)
        self._skip = False
        self.skipped_steps += 1
        clear_gradients(self.optimizer)
        self._show_skip()
        if not self.active:  # the pass-through this skip kept in place goes now
            self._remove()
        return loss

    def _tick(self) -> None:
        self._backoffs = [(f, n - 1, k) for f, n, k in self._backoffs if n > 1]

    def uninstall(self, keep_skip: bool = False) -> None:
        """Restore the optimizer's step. ``keep_skip``: a skip already decided for the step under
        way (a halt in the same step close, before a framework's optimizer.step()) keeps the
        wrapper for that one call."""
        self.active = False
        remove_step_pre_hook(self.optimizer, self._unwrapped_hook)
        if not (keep_skip and self._skip):
            self._remove()  # (a step() under way when called still finishes as decided)
            if not self._stepping:  # not kept: a pass-through left must not withhold an update
                self._skip = False
        if not self._stepping:  # announced, queued for an update no hook will see: run now
            self._run_pending()
            if not self._skip:
                self._release()

    def _run_pending(self) -> None:
        pending, self._after_step = self._after_step, {}
        for fn in pending.values():
            self._run_guarded(fn)

    def _release(self) -> None:
        """Drop every reference back to the monitor (nothing is pending): a pass-through left in
        a wrapper chain (an LR scheduler built after attach) lives as long as the optimizer."""
        self._before_step = self._run_guarded = self._judge_again = None

    def _remove(self) -> None:
        self._unshow_skip()
        if self.optimizer.__dict__.get("step") is self._wrapper:
            previous = self._instance_step
            while (left := _pass_through(previous)) is not None:  # goes with ours
                previous = left._instance_step
            if previous is None:
                del self.optimizer.step
            else:
                self.optimizer.step = previous  # type: ignore[method-assign]
        if self._accelerate is None:
            return
        accelerated, original, patched = self._accelerate
        if accelerated._optimizer_original_step_method is self._wrapper:
            while (left := _pass_through(original)) is not None and left._accelerate is not None:
                _, original, patched = left._accelerate  # goes with ours
            accelerated._optimizer_original_step_method = original
            accelerated._optimizer_patched_step_method = patched


def clear_gradients(optimizer: torch.optim.Optimizer) -> None:
    """What ``zero_grad(set_to_none=True)`` does, for a skipped step, without calling an
    override of zero_grad that may not take set_to_none (``zero_grad(self)``): that raised from
    optimizer.step() and stopped training."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            p.grad = None


class _Withheld(Exception):
    """Raised from the optimizer's closure once its step is judged to skip: the optimizer's
    step ends there, before its update."""

    def __init__(self, control: OptimizerControl, loss: Any) -> None:
        super().__init__("numwatch: skip_step withholds this update")
        self.control = control
        self.loss = loss


def _cannot_restore() -> None:
    raise NumwatchError(
        "numwatch ended this step in its closure (skip_step withheld the update, or a halt "
        "stopped training), but the optimizer had changed its parameters before calling its "
        "closure (as SAM's ascent step does) in a step numwatch did not copy them for (it had "
        "called its closure once, first, until then): they stay as it left them; its steps "
        "are copied from now on"
    )


class _Judging:
    """The closure an optimizer's step gets: each call is judged (``OptimizerControl._judged``).
    ``moved``: the optimizer changed its parameters before a call (or between calls), as their
    versions show. A change written through ``p.data`` (as many SAM ports write the ascent)
    leaves the version as it was: ``unseen`` holds device flags of the ``watched`` parameters'
    values against the step's copy of them (the first closure step) or their checksums at its
    start (a step taken for one that calls its closure first), read only where it matters."""

    def __init__(
        self,
        control: OptimizerControl,
        closure: Callable[[], Any],
        snapshot: _Snapshot | None,
        watched: list[torch.Tensor] | None,
    ) -> None:
        self.control = control
        self.closure = closure
        self.snapshot = snapshot
        self.watched = watched or []
        self.versions = list(map(_VERSION, self.watched)) if snapshot is None else []
        self.sums = self._checksums() if snapshot is None else []
        self.unseen: list[torch.Tensor] = []
        self.calls = 0
        self.moved = False

    def __call__(self) -> Any:
        control = self.control
        self.calls += 1
        if self.snapshot is not None:
            self.moved = self.moved or self.snapshot.moved()
            control._in_place |= self.snapshot.changed_in_place()  # copied from the next step
            if self.watched and not self.moved and self.calls == 1:  # (learning)
                self.unseen += (
                    control._run_guarded(partial(self.snapshot.differ, self.watched)) or []
                )
        elif self.watched:
            self.moved = self.moved or list(map(_VERSION, self.watched)) != self.versions
            if not self.moved:
                self.unseen += map(torch.ne, self._checksums(), self.sums)
        if self.moved or self.calls > 1:
            control._moves_first = True
        loss = self.closure()
        control._judged(self, loss)
        return loss

    def _checksums(self) -> list[torch.Tensor]:
        return self.control._run_guarded(partial(_checksums, self.watched)) or []

    def moved_unseen(self) -> bool:
        """The watched parameters changed before a call with no version change.
        SYNC: a read of a flag or a few, where a step ends in its closure or the first closure
        step of an optimizer ends."""
        flags = self.unseen
        return bool(flags) and bool(self.control._run_guarded(lambda: any(map(bool, flags))))


class _Snapshot:
    """An optimizer's parameters and state at the start of a step, put back bitwise when a skip
    ends the step after the optimizer changed them. The state is copied shallowly (dicts and
    lists anew, tensors by reference: an optimizer mostly replaces its tensors, as SAM's
    ``old_p`` and LBFGS's directions), except the tensors under ``in_place`` keys, seen changed
    in place before a closure call in an earlier step (LBFGS's ``prev_flat_grad``): copied."""

    def __init__(self, optimizer: torch.optim.Optimizer, in_place: set[Hashable]) -> None:
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        self.versions = list(map(_VERSION, self.params))
        with torch.no_grad():
            self.values = [torch.empty_like(p) for p in self.params]
            torch._foreach_copy_(self.values, self.params)
        self.state = {p: _state_copy(s, in_place) for p, s in optimizer.state.items()}
        self.tensors = [  # (key, tensor, its version) of the state held by reference
            (key, t, t._version)
            for s in self.state.values()
            if isinstance(s, dict)
            for key, t in s.items()
            if isinstance(t, torch.Tensor) and key not in in_place
        ]

    def moved(self) -> bool:
        return list(map(_VERSION, self.params)) != self.versions

    def differ(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """Device flags: each of ``params`` (of this optimizer) differs bitwise from its copy."""
        copies = {id(p): v for p, v in zip(self.params, self.values, strict=True)}
        with torch.no_grad():
            return [
                torch.ne(_bits(p), _bits(copies[id(p)])).any() for p in params if id(p) in copies
            ]

    def changed_in_place(self) -> set[Hashable]:
        return {key for key, t, version in self.tensors if t._version != version}

    def restore(self, optimizer: torch.optim.Optimizer) -> None:
        with torch.no_grad():
            torch._foreach_copy_(self.params, self.values)
        state = optimizer.state
        for p in [p for p in state if p not in self.state]:  # state the step began
            del state[p]
        for p, saved in self.state.items():
            current = state.get(p)
            if isinstance(current, dict) and isinstance(saved, dict):
                current.clear()  # the same dict: an optimizer may hold it
                current.update(saved)
            else:
                state[p] = saved
        changed = self.changed_in_place()
        if changed:
            optimizer_name = type(optimizer).__name__
            raise NumwatchError(
                f"skip_step put the parameters back, but {optimizer_name} had changed its state "
                f"{sorted(map(str, changed))} in place before calling its closure: that state "
                "is as it left it (it is copied from the next step on)"
            )


def _state_copy(state: Any, in_place: set[Hashable]) -> Any:
    """One parameter's optimizer state, to put back: see ``_Snapshot``."""
    if not isinstance(state, dict):
        return state
    out = {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and key in in_place:
            value = value.clone()
        elif isinstance(value, list | dict | set):
            value = copy.copy(value)
        out[key] = value
    return out


def _bits(p: torch.Tensor) -> torch.Tensor:
    """``p``'s local elements read as integers of their size (a NaN equals itself), or as they
    are where no integer dtype has that size."""
    t = local_tensor(p.detach())
    bits = _BITS.get(t.element_size())
    return t if bits is None or t.dtype == bits else t.view(bits)


def _checksums(params: list[torch.Tensor]) -> list[torch.Tensor]:
    """The sum of each parameter's bits (``_bits``), on its device: it changes when any element
    does, short of changes that cancel to the last bit."""
    with torch.no_grad():
        return [b.sum(dtype=torch.int64) for b in map(_bits, params) if b.dtype in _INTEGERS]


def _evaluates_first(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer``'s step is one of torch.optim's own, which call the closure once,
    before they change anything; LBFGS calls it again after moving its parameters."""
    module = getattr(type(optimizer).step, "__module__", None) or ""
    return module.startswith("torch.optim.") and module != "torch.optim.lbfgs"


def moves_before_closure(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer``'s step may change its parameters before calling its closure (SAM's
    ascent): any step but torch.optim's own (LBFGS moves them only between its calls)."""
    module = getattr(getattr(type(optimizer), "step", None), "__module__", None) or ""
    return not module.startswith("torch.optim.")


def _pass_through(step: Any) -> OptimizerControl | None:
    """The control whose wrapper ``step`` is, if that wrapper only passes calls on now: another
    monitor's on this optimizer, detached while ours wrapped it (uninstalled, no skip kept)."""
    control = getattr(getattr(step, "__func__", None), "_numwatch_control", None)
    return control if control is not None and not (control.active or control._skip) else None


def _running_accelerated(optimizer: torch.optim.Optimizer) -> Any:
    """The Accelerate ``AcceleratedOptimizer`` around ``optimizer`` whose step() is running, found
    up the call stack (Accelerate keeps no way back from the optimizer it wraps); None if none."""
    wrapper = getattr(sys.modules.get("accelerate.optimizer"), "AcceleratedOptimizer", None)
    code = getattr(getattr(wrapper, "step", None), "__code__", None)
    frame = sys._getframe(1) if code is not None else None
    while frame is not None:
        if frame.f_code is code:
            owner = frame.f_locals.get("self")
            if getattr(owner, "optimizer", None) is optimizer:
                return owner
        frame = frame.f_back
    return None


def _skip_flag(accelerated: Any) -> str | None:
    """The attribute of Accelerate's wrapper through which its ``step_was_skipped`` shows a
    skip of ours: its step() sets ``_is_overflow`` (what the property reads) from
    ``_accelerate_step_called`` with a GradScaler, and nothing sets it without one. None where
    this accelerate reads or sets them otherwise (the names its code uses tell)."""
    cls = type(accelerated)
    shown = getattr(inspect.getattr_static(cls, "step_was_skipped", None), "fget", None)
    names = getattr(getattr(shown, "__code__", None), "co_names", ())
    if "_is_overflow" not in names or not hasattr(accelerated, "_is_overflow"):
        return None
    if getattr(accelerated, "scaler", None) is None:
        return "_is_overflow"
    step = getattr(inspect.getattr_static(cls, "step", None), "__code__", None)
    if "_accelerate_step_called" not in getattr(step, "co_names", ()) or not hasattr(
        accelerated, "_accelerate_step_called"
    ):
        return None
    return "_accelerate_step_called"


def _unscale_once(scaler: Any, optimizer: torch.optim.Optimizer) -> None:
    """``scaler.unscale_(optimizer)`` unless the user already called it for this step (to clip
    the gradients, as torch's AMP recipe does): a second call raises, and the first one's inf
    check is the one update() reads. The stage is GradScaler's private per-optimizer state;
    where it cannot be read, unscale_ is called and its refusal to unscale twice taken as that
    answer."""
    states = getattr(scaler, "_per_optimizer_states", None)
    state = states.get(id(optimizer)) if isinstance(states, dict) else None
    stage = getattr(state.get("stage"), "name", None) if isinstance(state, dict) else None
    if stage is not None and stage != "READY":
        return  # UNSCALED: the user's unscale_ stands
    try:
        scaler.unscale_(optimizer)
    except RuntimeError:
        if stage is not None:  # known to be READY: not the twice-unscaled refusal
            raise


def _skipped_by_scaler(optimizer: torch.optim.Optimizer) -> bool:
    """The update of the step just run was skipped: GradScaler hands a fused optimizer
    (``_step_supports_amp_scaling``) ``found_inf`` for the step, non-zero on an overflow."""
    found_inf = getattr(optimizer, "found_inf", None)
    return found_inf is not None and bool(found_inf)  # SYNC: only with a back-off or clip pending
