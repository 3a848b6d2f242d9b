"""The `llmc` group: every command registered, and the last line of defence that turns stray errors into one line."""

from __future__ import annotations

import click

from llmc_cli import __version__
from llmc_cli.commands.console import fail, one_line
from llmc_cli.commands.options import usage_error_line


def _tolerant_streams() -> None:
    """A terminal whose encoding cannot show a character (PYTHONIOENCODING=ascii, a Latin-1 locale) shows it as an
    escape: a path or a sampled word with an é must not end a run with UnicodeEncodeError. (Streams already set to
    carry undecodable bytes, surrogateescape under the C locale, stay as they are.)"""
    import sys
    for stream in (sys.stdout, sys.stderr):
        if getattr(stream, "errors", None) == "strict":
            try:
                stream.reconfigure(errors="backslashreplace")
            except (AttributeError, ValueError, OSError):  # (not a TextIOWrapper: a test's, a pipe's wrapper)
                pass


class _Main(click.Group):
    """Last line of defence: a missing optional package or exhausted memory is one line, not a traceback."""

    def invoke(self, ctx):
        _tolerant_streams()
        try:
            return super().invoke(ctx)
        except click.UsageError as e:  # a bad option value or a misspelt command: one line, exit 2
            fail(usage_error_line(e), code=e.exit_code)
        except ModuleNotFoundError as e:
            from llmc_cli.commands.console import missing_package_message
            fail(missing_package_message(e))
        except MemoryError as e:
            fail(f"out of host memory ({e or 'MemoryError'}); lower -b/--batch-size or -t/--seq-len")
        except KeyboardInterrupt:  # Ctrl-C outside a training loop (which stops gracefully on its own)
            fail("interrupted", code=130)
        except OSError as e:  # a full disk, a read-only file system, no permission: the path and the reason
            fail(one_line(e))


@click.group(cls=_Main, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(__version__, prog_name="llmc")
def main() -> None:
    """llmc: train GPT-2 and Llama 3 from scratch, llm.c style, on whatever hardware is here.

    \b
    Example:
      llmc tokenize shakespeare
      llmc train --backend cpu --model d6 -b 4 -t 64 --steps 50 --out checkpoints/demo
      llmc sample --checkpoint checkpoints/demo --prompt "ROMEO:"
    """


def _register() -> None:
    """Every command lives in its own module; they import the consoles below them, never this group."""
    from llmc_cli.commands import backends, bench, eval, plot, sample, tokenize, train
    from llmc_cli.commands.convert import convert
    for cmd in (tokenize.tokenize, train.train, sample.sample, eval.eval_cmd, convert, bench.bench, plot.plot,
                backends.backends):
        main.add_command(cmd)


_register()
