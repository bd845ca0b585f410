"""What the PPO loop needs from its surroundings besides the workers: Slurm's preemption signals and the
progress bar over steps (used by ppo/ray_trainer.py)."""

from __future__ import annotations


class PreemptionSignals:
    """SIGTERM / SIGUSR1 -> an event the loop checks after each step; `uninstall()` puts the previous
    handlers back. Slurm sends one before a time limit or a preemption (`--signal=B:USR1@120`)."""

    SIGNALS = ("SIGTERM", "SIGUSR1")

    def __init__(self):
        import threading

        self._event = threading.Event()
        self.name = None
        self._previous = {}

    def is_set(self) -> bool:
        return self._event.is_set()

    def _handle(self, signum, frame) -> None:
        import signal

        self.name = signal.Signals(signum).name
        if not self._event.is_set():
            print(f"megappo: {self.name}: finishing the step in flight, then a checkpoint and exit", flush=True)
        self._event.set()

    def install(self) -> "PreemptionSignals":
        import signal
        import threading

        if threading.current_thread() is threading.main_thread() and not self._previous:
            for name in self.SIGNALS:  # signal handlers can only be set from the main thread
                sig = getattr(signal, name)
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        import signal

        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}


class StepProgress:
    """A rich progress bar over steps (score / correct rate / step time in its description)."""

    def __init__(self, total: int, done: int, enabled: bool, label: str = "PPO"):
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, \
            TimeRemainingColumn

        self.console = Console()
        self.progress = Progress(TextColumn(f"[bold]{label}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                 TextColumn("eta"), TimeRemainingColumn(), TextColumn("{task.description}"),
                                 console=self.console, disable=not enabled, transient=False)
        self.task = self.progress.add_task("", total=total, completed=done)

    def __enter__(self) -> "StepProgress":
        self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.stop()

    def advance(self, m: dict) -> None:
        desc = (f"score {m['objective/scores']:.3f}  correct {m['objective/verifiable_correct_rate']:.2f}  "
                f"kl {m['objective/kl']:.3f}  {m['time/training']:.1f}s/step")
        self.progress.update(self.task, advance=1, description=desc)
