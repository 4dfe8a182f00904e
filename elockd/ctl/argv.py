"""Where elockctl's options end, read before argparse sees the command line.

argparse alone gets two things wrong for a flock(1) user:

* ``elockctl lock nightly ./job.sh -s`` must run ``./job.sh -s``: flock stops
  reading options at the command, and a ``-s`` taken for elockctl's own would
  make the lock shared and let two copies of the job run at once. So the first
  word after ``lock``'s KEY (``throttle``'s KEY and COUNT/PERIOD) that is not an
  option starts COMMAND, and everything from there is COMMAND's, options included
  (``--`` still works, as in flock).
* Global options may come before or after the command (``elockctl i x --port
  9999``), and an unknown option is blamed by name with a suggestion (``--prot``:
  did you mean ``--port``?), not the value that follows it.

:func:`arrange` walks the words once, knowing which options take a value from
the parsers themselves, and hands argparse the global options first, then the
command and its own words; COMMAND's words come back apart, untouched.
"""

from __future__ import annotations

import argparse
import difflib
from dataclasses import dataclass, field
from typing import Any, NoReturn

#: Commands whose words after the options are handed on untouched: ``lock``'s and
#: ``throttle``'s COMMAND (from the first word after their own positionals, or
#: after ``--``), ``upgrade``'s elockd flags (after ``--``).
TAIL_COMMANDS = ("lock", "throttle", "upgrade")
#: How many positionals come before COMMAND: ``lock KEY``, ``throttle KEY RATE``.
BEFORE_COMMAND = {"lock": 1, "throttle": 2}


@dataclass
class Arranged:
    """The command line in the order argparse reads it, and the untouched tail."""

    words: list[str] = field(default_factory=list)
    command: str | None = None
    tail: list[str] | None = None


def options_of(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Every option string of ``parser`` and the action it names."""
    return {name: action for action in parser._actions for name in action.option_strings}


def takes_value(action: argparse.Action) -> bool:
    return action.nargs != 0


def suggestion(word: str, candidates: list[str]) -> str:
    close = difflib.get_close_matches(word, candidates, n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


class Scanner:
    """One pass over the words; ``fail`` reports a mistake the argparse way."""

    def __init__(self, parser: argparse.ArgumentParser, commands: dict[str, Any]) -> None:
        self.parser = parser
        self.commands = commands
        self.globals = options_of(parser)

    def arrange(self, raw: list[str]) -> Arranged:
        out = Arranged()
        front: list[str] = []  # global options, wherever they stood
        own: list[str] = []  # the command and its own words
        positionals = 0
        index = 0
        while index < len(raw):
            word = raw[index]
            if out.command is not None and word == "--":
                if out.command in TAIL_COMMANDS:
                    out.tail = raw[index + 1 :]
                else:
                    own.extend(raw[index:])  # argparse reads the rest as positionals
                break
            if word.startswith("-") and word != "-":
                taken, is_global = self.option(word, raw[index + 1 :], out.command)
                (front if is_global else own).extend(raw[index : index + taken])
                index += taken
                continue
            if out.command is None:
                if word not in self.commands:
                    self.unknown_command(word)
                out.command = word
                own.append(word)
            elif positionals == BEFORE_COMMAND.get(out.command):
                out.tail = raw[index:]  # past KEY (and RATE): COMMAND starts here
                break
            else:
                own.append(word)
                positionals += 1
            index += 1
        out.words = front + own
        return out

    def option(self, word: str, after: list[str], command: str | None) -> tuple[int, bool]:
        """How many words the option ``word`` takes (itself and its value), and
        whether it is a global option (else the command's own)."""
        own = options_of(self.commands[command]) if command else {}
        # upgrade's words after its own options are the new elockd's: they go after
        # '--', and a global option there would be taken silently for elockctl's.
        usable = own if command == "upgrade" else {**self.globals, **own}
        if word.startswith("--"):
            name, has_value, _ = word.partition("=")
            action = usable.get(name) or self.abbreviation(name, usable, command)
            needs = takes_value(action) and not has_value
            return (2 if needs else 1), action not in own.values()
        # Short options, clustered as getopt allows: -sn, -w5, -nw 5. The cluster is
        # global or the command's own as its first letter is (they never mix).
        first: argparse.Action | None = None
        for at, letter in enumerate(word[1:], start=1):
            found = usable.get(f"-{letter}")
            if found is None:
                self.unknown_option(f"-{letter}", usable, command, word)
            first = first or found
            if takes_value(found):
                return (1 if word[at + 1 :] else 2), first not in own.values()
        return 1, first not in own.values()

    def abbreviation(
        self, name: str, usable: dict[str, argparse.Action], command: str | None
    ) -> argparse.Action:
        """A unique prefix of a long option stands for it, as argparse allows."""
        matches = sorted({option for option in usable if option.startswith(name) and len(name) > 2})
        actions = {usable[option] for option in matches}
        if len(actions) == 1:
            return actions.pop()
        if len(actions) > 1:
            self.failing(command).error(f"ambiguous option {name}: {', '.join(matches)}")
        self.unknown_option(name, usable, command, name)

    def unknown_option(
        self, name: str, usable: dict[str, argparse.Action], command: str | None, word: str
    ) -> NoReturn:
        hint = suggestion(name, [o for o in usable if o.startswith("--") == name.startswith("--")])
        shown = name if word == name else f"{name} (in {word})"
        if command == "upgrade" and not hint:
            hint = " (the new elockd's flags go after '--')"
        self.failing(command).error(f"unknown option {shown}{hint}")

    def unknown_command(self, word: str) -> NoReturn:
        hint = suggestion(word, list(self.commands))
        choices = " ".join(self.commands)
        self.parser.error(f"unknown command '{word}'{hint or f' (one of: {choices})'}")

    def failing(self, command: str | None) -> argparse.ArgumentParser:
        return self.commands[command] if command else self.parser
