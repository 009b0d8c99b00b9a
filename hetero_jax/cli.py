"""``hetero-jax`` command line: ``hetero-jax generate ...``, ``hetero-jax serve ...``, ``hetero-jax models``,
``hetero-jax launch -n N -- generate ...``."""

from __future__ import annotations

import argparse
import sys


def _add_generate(sub) -> None:
    p = sub.add_parser(
        "generate",
        help="generate a continuation (chat answer by default) for one prompt",
        description="Generate text with a converted model or a known model name. Prints the answer, "
        "then one line of stats.",
    )
    p.add_argument("--model", default="smollm2-135m", help="known model name or converted checkpoint dir (default: smollm2-135m)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-file",
                     help="read the prompt from this UTF-8 file ('-' for stdin), as --prompt \"$(cat FILE)\" "
                          "passes it: its final line break(s) and a leading BOM are dropped, CRLF read as LF")
    p.add_argument("--max-new-tokens", type=int, default=256, help="the answer's length limit in tokens, >= 1 "
                   "(default: 256)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (with --temperature > 0)")
    p.add_argument("--seed", type=int, default=None, help="the sampling seed (default 0; with --temperature > 0)")
    p.add_argument("--stop", action="append", default=None,
                   help="stop string (repeatable); a special token's text, e.g. '<|im_end|>', also stops at that "
                        "token")
    p.add_argument("--no-chat", action="store_true", help="do not apply the checkpoint's chat template")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None, help="compute dtype (default: checkpoint's)")
    p.add_argument("--no-stream", action="store_true", help="print the answer at the end instead of streaming it")
    p.add_argument("--policy", default="full", help="KV-cache policy name; 'list' prints them (default: full)")
    p.add_argument("--budget", type=float, default=None,
                   help="rho: fraction of the prompt's KV kept on the device, in (0, 1] (default: the policy's)")
    p.add_argument("--profile", default=None,
                   help="heterocache / synckv / profiledsnapkv: head profile JSON (default: the shipped profile of "
                        "the model)")
    p.add_argument("--window", type=int, default=None, help="heterocache: decode steps between drift checks (5)")
    p.add_argument("--tau-drift", type=float, default=None,
                   help="heterocache: drift when the median chance-normalised overlap (o - c) / (1 - c) falls "
                        "below this (default: the profile's tau_stable on that scale, 0.25 for SmolLM2)")
    p.add_argument("--select-window", type=int, default=None,
                   help="heterocache: compressed heads keep their top tokens by the attention of this many last "
                        "prompt queries (16; 1 = the paper's last token)")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="a policy option, repeatable, e.g. --policy quest --option offload=true --option page_size=16 "
                        "(true/false, integers, numbers or text; also written --policy quest:offload=true)")
    # default None, not 1: in a multi-process job "neither given" (tensor parallel over every device) must differ
    # from an explicit --tp 1
    p.add_argument("--tp", type=int, default=None,
                   help="tensor parallel: split heads and MLP over this many devices (must divide the KV heads; "
                        "default 1, or every device of a multi-process job when --dp is not given either)")
    p.add_argument("--dp", type=int, default=None,
                   help="data parallel, in a multi-process job only (one prompt has no batch to split): with --tp, "
                        "the mesh must span the job's devices (default 1)")
    p.add_argument("--turns", default=None, metavar="FILE",
                   help="multi-turn session: the prompt is the context, each non-empty line of this UTF-8 file "
                        "a question ('-' for stdin, when the prompt is not read from it)")


def _add_launch(sub) -> None:
    p = sub.add_parser(
        "launch",
        help="run generate in N processes on this machine, joined into one JAX job",
        description="Start N processes of a hetero-jax command on this machine with JAX_COORDINATOR_ADDRESS, "
        "JAX_NUM_PROCESSES and JAX_PROCESS_ID set (what a cluster's launcher sets on several hosts); the model "
        "is split over all their devices. Process 0 prints; when a process fails, the others are stopped and "
        "launch exits with its code. Example: hetero-jax launch -n 2 -- generate --model DIR --prompt TEXT",
    )
    p.add_argument("-n", "--processes", type=int, required=True, help="number of processes")
    p.add_argument("--devices-per-process", type=int, default=None, metavar="K",
                   help="K simulated CPU devices per process (on a GPU host: GPUs iK..iK+K-1 for process i; "
                        "default: GPU i, one per process)")
    p.add_argument("launched", nargs=argparse.REMAINDER, metavar="-- generate ...",
                   help="the command every process runs, after --")


def _add_serve(sub) -> None:
    p = sub.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API (conversations keep their KV cache)",
        description="Serve one model over OpenAI's HTTP API (GET /v1/models, POST /v1/chat/completions, POST "
        "/v1/completions, GET /health, GET /metrics). A chat request that extends a conversation the server holds "
        "continues its Session instead of prefilling the history again (docs/serve.md).",
    )
    p.add_argument("--model", default="smollm2-135m",
                   help="known model name or converted checkpoint dir (default: smollm2-135m)")
    p.add_argument("--served-model-name", default=None,
                   help="the model id clients send (default: --model, or a checkpoint dir's name)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                   help="compute dtype (default: checkpoint's)")
    p.add_argument("--policy", default="full",
                   help="default KV-cache policy, with options as in generate (default: full)")
    p.add_argument("--budget", type=float, default=None, help="rho of the default policy (default: the policy's)")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE", help="a policy option, repeatable")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1, this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    p.add_argument("--max-sessions", type=int, default=16,
                   help="conversations held between requests, least recently used evicted first (default: 16; 0: "
                        "none)")
    p.add_argument("--host-memory", default=None, metavar="SIZE",
                   help="bound on the host KV bytes of held conversations, e.g. 8GiB (default: none)")
    p.add_argument("--device-memory", default=None, metavar="SIZE",
                   help="bound on the device KV bytes of held conversations, e.g. 20GiB (default: none)")
    p.add_argument("--max-queue", type=int, default=64, help="requests that may wait for the engine (default: 64)")
    p.add_argument("--max-tokens", type=int, default=512,
                   help="a chat answer's length when the request gives no max_tokens (default: 512)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])


def _cmd_serve(args) -> int:
    """Check every flag and build the policy before loading the model; then serve until interrupted."""
    import os

    from hetero_jax.errors import ConfigError
    from hetero_jax.policies import make_policy, parse_options

    for flag, value, lo in (("--port", args.port, 0), ("--max-sessions", args.max_sessions, 0),
                            ("--max-queue", args.max_queue, 1), ("--max-tokens", args.max_tokens, 1)):
        if value < lo or (flag == "--port" and value > 65535):
            raise ConfigError(f"{flag} {value} is out of range: give " + (
                "a port in [0, 65535]" if flag == "--port" else f"an integer >= {lo}"))
    options = parse_options(args.option)
    policy = make_policy(args.policy, args.budget, **options)  # a bad name or option: exit 2, nothing loaded
    import importlib.util

    missing = [m for m in ("starlette", "uvicorn") if importlib.util.find_spec(m) is None]
    if missing:
        raise ConfigError(f"hetero-jax serve needs {' and '.join(missing)}, which are not installed; install the "
                          "server's stack with pip install 'hetero-jax[serve]'")
    from hetero_jax.serve import ServeConfig, create_app, parse_size
    from hetero_jax.serve.listen import bind_socket, serve, url

    host_bytes = None if args.host_memory is None else parse_size(args.host_memory, "--host-memory")
    device_bytes = None if args.device_memory is None else parse_size(args.device_memory, "--device-memory")
    # the last check: --host resolves and --port is free (bound now; uvicorn listens on it once the model is loaded)
    sock = bind_socket(args.host, args.port)
    try:
        enable_compilation_cache()
        import hetero_jax

        model = hetero_jax.load(args.model, dtype=args.dtype)
        name = args.served_model_name or (os.path.basename(os.path.normpath(args.model)) if os.path.isdir(args.model)
                                          else args.model)
        config = ServeConfig(model_id=name, policy=policy, policy_name=args.policy, max_sessions=args.max_sessions,
                             max_device_bytes=device_bytes, max_host_bytes=host_bytes, max_queue=args.max_queue,
                             max_tokens=args.max_tokens)
        serve(create_app(model, config), sock, log_level=args.log_level,
              banner=f"serving {name} ({policy!r}) on {url(sock)}/v1")
    finally:
        sock.close()
    return 0


def _read_prompt(args) -> str:
    """The prompt of --prompt, --prompt-file FILE or --prompt-file - (stdin); PromptError (exit 2) for text that
    is not UTF-8, before the model is loaded."""
    from hetero_jax.io.tokenizer import check_unicode

    if args.prompt is not None:
        check_unicode(args.prompt, "--prompt")  # a non-UTF-8 byte of the command line comes as a surrogate
        return args.prompt
    return read_text(args.prompt_file, "--prompt-file", "prompt file", "the prompt")


def read_text(path: str, flag: str, what: str, stdin_what: str) -> str:
    """The text of file ``path`` (``-``: stdin) as ``"$(cat FILE)"`` passes it: a leading UTF-8 BOM dropped,
    CRLF line ends as LF, the final line break(s) dropped; inner text unchanged. A file and stdin give the same
    string (both are read as bytes: a file opened as text would turn CRLF into LF and stdin not). PromptError
    (exit 2) naming ``flag`` and the path (``what`` and ``stdin_what`` name the text) when it cannot be read."""
    from hetero_jax.errors import PromptError

    if path == "-":
        where, data = f"{stdin_what} read from stdin", sys.stdin.buffer.read()
    else:
        where, data = f"{what} {path!r}", read_file_bytes(path, flag, what)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise PromptError(f"{where} is not UTF-8 text ({e.reason} at byte {e.start}); {flag} "
                          f"{'- ' if path == '-' else ''}takes UTF-8 text") from None
    return text.removeprefix("\ufeff").replace("\r\n", "\n").rstrip("\n")


def read_file_bytes(path: str, flag: str, what: str) -> bytes:
    """A file's bytes; PromptError (exit 2) naming the flag and the path otherwise."""
    from hetero_jax.errors import PromptError

    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        raise PromptError(f"{what} not found: {path!r} ({flag} takes a UTF-8 text file)") from None
    except IsADirectoryError:
        raise PromptError(f"{what} {path!r} is a directory; {flag} takes a UTF-8 text file") from None
    except OSError as e:
        raise PromptError(f"cannot read {what} {path!r}: {e.strerror or e}") from None


def _check_generate_args(args) -> list[str] | None:
    """The decoding flags, checked before the model is loaded; returns the questions of --turns (or None)."""
    from hetero_jax.errors import PromptError
    from hetero_jax.runtime.prompts import check_request

    # the API takes 0 (a prefill-only call); on the command line it loads and prefills to print nothing
    if args.max_new_tokens < 1:
        raise PromptError(f"--max-new-tokens must be >= 1 (the answer's length limit in tokens), got "
                          f"{args.max_new_tokens}")
    given_seed = args.seed is not None
    args.seed = args.seed if given_seed else 0
    check_request(args.max_new_tokens, args.temperature, args.top_p, seed=args.seed, stop=args.stop)
    ignored = [f for f, given in (("--top-p", args.top_p != 1.0), ("--seed", given_seed)) if given]
    if args.temperature == 0 and ignored:  # greedy: they would change nothing, which a user should hear
        print(f"note: {' and '.join(ignored)} {'has' if len(ignored) == 1 else 'have'} no effect at --temperature 0 "
              "(greedy); give --temperature > 0 to sample", file=sys.stderr)
    if args.turns is None:  # "" is a path (not found), as an unset shell variable in --turns "$FILE" gives
        return None
    if args.turns == "-" and args.prompt_file == "-":
        raise PromptError("--turns - and --prompt-file - both read stdin; give the questions or the prompt as a "
                          "file")
    # one question per line: split at "\n" only (str.splitlines also breaks at U+2028, form feeds, ...)
    lines = read_text(args.turns, "--turns", "turns file", "the turn list").split("\n")
    questions = [q.strip() for q in lines if q.strip()]
    if not questions:
        where = "stdin" if args.turns == "-" else f"turns file {args.turns!r}"
        raise PromptError(f"{where} holds no questions (one per line)")
    return questions


# No process holds more devices than this; --tp x --dp past it is a mistake (and XLA aborts on a count it
# cannot read, or runs out of memory simulating thousands of CPU devices).
MAX_DEVICES_PER_PROCESS = 64


def check_mesh_flags(tp: int, dp: int, distributed: bool) -> None:
    """--tp and --dp (each >= 1, which the parser checks) before JAX starts (MeshError): their product a device
    count one process can hold, and, outside a multi-process job, no --dp: generate runs one prompt, which data
    parallelism cannot split (every data-parallel device would repeat the whole run)."""
    from hetero_jax.model.sharding import MeshError

    if distributed:  # the job's devices are its processes' own; _generate_mesh checks --tp x --dp against them
        return
    if tp * dp > MAX_DEVICES_PER_PROCESS:
        raise MeshError(f"--tp {tp} x --dp {dp} = {tp * dp} devices, more than one process holds (at most "
                        f"{MAX_DEVICES_PER_PROCESS}); --tp must divide the model's KV heads")
    if dp > 1:
        raise MeshError(f"--dp {dp} splits a batch over devices, but generate runs one prompt: each of the {dp} "
                        "data-parallel devices would repeat the whole run. Leave out --dp (--tp splits one "
                        "prompt's heads), or batch prompts with the Python API on make_mesh(tp=..., dp=...)")


def simulate_cpu_devices(n: int) -> None:
    """Let a CPU-only run build an n-device mesh: XLA's host platform splits into n devices when told so
    before JAX starts (no effect on GPUs; a no-op once JAX's backends exist or the flag is set)."""
    import os

    flags = os.environ.get("XLA_FLAGS", "")
    if n > 1 and "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def enable_compilation_cache() -> bool:
    """Persist XLA executables under the hetero-jax cache dir, so repeated CLI runs skip most compiles. A
    directory that cannot be created or written (HETERO_JAX_CACHE at a file or a read-only directory) gets
    one warning and the run goes on without the cache (JAX would warn at every compile). Returns whether the
    cache is on."""
    import os
    import warnings

    import jax

    from hetero_jax.io.files import dir_problem
    from hetero_jax.io.hub import cache_dir

    folder = os.path.join(cache_dir(), "xla")
    problem = dir_problem(folder)
    if problem:
        warnings.warn(f"the compile cache {folder} cannot be used ({problem}); compiling without it (point "
                      "HETERO_JAX_CACHE at a writable directory to keep compiles between runs)", RuntimeWarning,
                      stacklevel=2)
        return False
    jax.config.update("jax_compilation_cache_dir", folder)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    return True


def mesh_flags(args) -> tuple[int, int, bool]:
    """``--tp`` and ``--dp`` (1 when not given), and whether either was given."""
    tp, dp = getattr(args, "tp", None), getattr(args, "dp", None)
    return 1 if tp is None else tp, 1 if dp is None else dp, tp is not None or dp is not None


def _generate_mesh(args, setup):
    """The mesh of ``--tp`` x ``--dp`` (None for one device); in a multi-process job it must span every
    process's devices (neither flag given: tensor parallel over all of them)."""
    from hetero_jax.model.sharding import make_mesh

    tp, dp, given = mesh_flags(args)
    if not setup.distributed:
        return make_mesh(tp, dp) if tp * dp > 1 else None
    import jax

    from hetero_jax.runtime.distributed import LaunchError

    n = jax.device_count()
    if not given:
        tp, dp = n, 1
    if tp * dp != n:
        unset = [f for f in ("tp", "dp") if getattr(args, f, None) is None]
        raise LaunchError(f"--tp {tp} x --dp {dp}{f' (--{unset[0]} not given: 1)' if given and unset else ''} = "
                          f"{tp * dp} devices, but the {jax.process_count()} processes hold {n}: a multi-process "
                          f"run's mesh spans every device; give --tp and --dp whose product is {n} (or neither: "
                          f"tensor parallel over all {n})")
    return make_mesh(tp, dp)


# generate's policy flags: (option, flag, the policies whose option it sets); other policies take their options
# as --option KEY=VALUE.
POLICY_FLAGS = (("profile", "--profile", ("heterocache", "synckv", "profiledsnapkv")),
                ("window", "--window", ("heterocache",)), ("tau_drift", "--tau-drift", ("heterocache",)),
                ("select_window", "--select-window", ("heterocache",)))


def _cmd_generate(args, setup) -> int:
    import hetero_jax
    from hetero_jax.model.sharding import MeshError
    from hetero_jax.policies import describe_policies, make_policy, parse_options, registry_key

    if args.policy == "list":
        print(describe_policies())
        return 0
    extra = parse_options(args.option)
    base = registry_key(args.policy)  # make_policy's key: "Hetero-Cache" and "hetero_cache" are heterocache
    # option -> (its flag, value) of the policies' own flags; one also given as --option is refused below
    flags = {key: (flag, getattr(args, key)) for key, flag, _ in POLICY_FLAGS if getattr(args, key) is not None}
    for key, flag, owners in POLICY_FLAGS:
        if key in flags and base not in owners:
            named = owners[0] if len(owners) == 1 else f"{', '.join(owners[:-1])} and {owners[-1]}"
            print(f"error: {flag} applies to --policy {named}; give --policy {base}'s options as "
                  "--option KEY=VALUE (hetero-jax generate --policy list names them)", file=sys.stderr)
            return 2
    for key, (flag, value) in flags.items():
        if key in extra:
            print(f"error: {flag} {value} and --option {key}={extra[key]!r} set one option twice; give it once",
                  file=sys.stderr)
            return 2
        extra[key] = value
    policy = make_policy(args.policy, args.budget, **extra)  # a bad name or value: HeteroJaxError, exit 2
    if args.budget is None and base != "full" and policy.budget >= 1.0 and setup.process_id == 0:
        print(f"note: --policy {base} without --budget keeps the whole prompt (its default budget is "
              f"{policy.budget:g}); give --budget RHO, e.g. 0.3, to compress", file=sys.stderr)
    if args.prompt is None and args.prompt_file is None:
        print("error: give --prompt TEXT or --prompt-file FILE", file=sys.stderr)
        return 2
    questions = _check_generate_args(args)
    prompt = _read_prompt(args)
    if not prompt.strip():
        from hetero_jax.errors import PromptError

        raise PromptError("empty prompt: the prompt text has no content; give --prompt TEXT or a --prompt-file "
                          "that holds text")
    enable_compilation_cache()
    mesh = _generate_mesh(args, setup)
    try:
        model = hetero_jax.load(args.model, dtype=args.dtype, mesh=mesh, progress=setup.process_id == 0)
    except MeshError as e:
        if not (setup.distributed and not mesh_flags(args)[2]):
            raise
        n = mesh.devices.size  # neither flag given: tensor parallel over the whole job
        raise MeshError(f"{e}. With neither --tp nor --dp, this job's {n} devices make tp={n}: give --tp T "
                        f"--dp {n}/T with T from that list and dividing {n} (e.g. --tp 1 --dp {n}, which repeats "
                        "the run on every device), or launch a number of devices that the KV heads divide by"
                        ) from None
    stream = not args.no_stream
    if args.turns is not None:
        return _run_turns(args, model, prompt, policy, stream, questions)
    res = hetero_jax.generate(
        model,
        prompt,
        policy,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        stop=args.stop,
        chat=not args.no_chat,
        on_token=(lambda s: print(s, end="", flush=True)) if stream else None,
    )
    if stream:
        print()
    else:
        print(res.text)
    print(f"[stats] {res.stats.summary()}", )
    return 0


def _run_turns(args, model, context: str, policy, stream: bool, questions: list[str]) -> int:
    from hetero_jax.runtime.prompts import stop_token_ids
    from hetero_jax.runtime.session import Session, check_turns_fit

    # every question against the context before the session prefills anything: a line that cannot fit is
    # refused now, not after the turns before it were answered; so is a --stop that could never match
    check_turns_fit(model, context, questions, chat=not args.no_chat)
    if args.stop:
        stop_token_ids(model.tokenizer, args.stop)
    sess = Session(model, context, policy, chat=not args.no_chat, seed=args.seed)
    for i, q in enumerate(questions, 1):
        print(f"[turn {i}] {q}")
        res = sess.ask(q, max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                       stop=args.stop, on_token=(lambda s: print(s, end="", flush=True)) if stream else None)
        print() if stream else print(res.text)
        print(f"[stats] {res.stats.summary()}")
    return 0


def _cmd_models(args) -> int:
    from hetero_jax.io.hub import KNOWN_MODELS, cache_dir

    for name, km in KNOWN_MODELS.items():
        print(f"{name:16s} {km.description}")
    print(f"(converted copies live in {cache_dir()}; set HETERO_JAX_CACHE to move them)")
    return 0


def _cmd_profile(args) -> int:
    """HeteroCache's profile and SyncKV's grouping are calibrated in profile/; each peer's own calibration lives
    beside its policy, which profile/ sits below (docs/architecture.md, "Layering")."""
    if args.method == "contextkeeper":
        from hetero_jax.policies.contextkeeper.cli import run_profile
    elif args.method == "hcattention":
        from hetero_jax.policies.hcattention.cli import run_profile
    else:
        from hetero_jax.profile.cli import run_profile
    return run_profile(args)


def long_options(command: argparse.ArgumentParser) -> list[str]:
    """Every long option of a command's parser (``launch`` resolves generate's abbreviated ones as argparse
    does)."""
    return [s for a in command._actions for s in a.option_strings if s.startswith("--")]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hetero-jax",
        description="Long-context LLM inference in JAX with heterogeneous KV-cache compression.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_generate(sub)
    _add_serve(sub)
    _add_launch(sub)
    sub.add_parser("models", help="list the known model names")
    from hetero_jax.profile.cli import add_profile_parser

    add_profile_parser(sub)
    parser.command_parsers = sub.choices  # name -> the command's parser, for its own usage in an error
    return parser


# 128 + SIGPIPE: what a shell reports for a command whose reader closed the pipe (`yes | head`), so a pipeline
# under `set -o pipefail` still sees that the output was cut short
STDOUT_CLOSED = 141


def _stdout_to_devnull() -> None:
    """Point stdout's file descriptor at devnull once its reader went away (``| head``): the interpreter's last
    flush of what is still buffered then writes nowhere instead of printing 'Exception ignored ...'."""
    import io
    import os

    try:
        fd = sys.stdout.fileno()
    except (AttributeError, ValueError, io.UnsupportedOperation):  # a stand-in stream: no descriptor to flush
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns its exit code (2: bad input, 130: interrupted, 141: stdout's reader closed it)."""
    try:
        code = _main(argv)
        sys.stdout.flush()  # here, not at exit: a reader gone by now is the BrokenPipeError below
        return code
    except BrokenPipeError:
        # the reader of stdout closed it (`hetero-jax generate ... | head`): the write that failed ended the
        # run (a streamed answer stops decoding there); no traceback, no message (nobody reads it)
        _stdout_to_devnull()
        return STDOUT_CLOSED


def _main(argv: list[str] | None) -> int:
    from hetero_jax.errors import INTERRUPTED, HeteroJaxError
    from hetero_jax.runtime.distributed import SINGLE, exit_on_failure, initialize_distributed, process_setup

    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # the command's own usage, not the top level's list of commands
        parser.command_parsers.get(args.command, parser).error(f"unrecognized arguments: {' '.join(extra)}")
    if any(v is not None and v < 1 for v in (getattr(args, "tp", None), getattr(args, "dp", None))):
        parser.error("--tp and --dp take a positive number of devices")
    if args.command is None:
        parser.print_help()
        return 2
    setup = SINGLE
    try:
        from hetero_jax.runtime import heap

        heap.flags()  # the environment's switches, before a model loads
        if args.command == "generate":
            # the job's variables before anything else: a bad one is refused before JAX starts; in a job the
            # devices are the processes' own (hetero-jax launch --devices-per-process simulates CPU ones)
            setup = process_setup()
            tp, dp, _ = mesh_flags(args)
            check_mesh_flags(tp, dp, setup.distributed)
            if not setup.distributed:
                simulate_cpu_devices(tp * dp)
            setup = initialize_distributed()
            with exit_on_failure(setup):
                if setup.process_id != 0:  # every process runs the same command; process 0 prints
                    import contextlib
                    import os

                    with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):
                        return _cmd_generate(args, setup)
                return _cmd_generate(args, setup)
        if args.command == "launch":
            from hetero_jax.launch import launch

            return launch(args.processes, args.launched,
                          devices_per_process=args.devices_per_process, options=long_options(parser.command_parsers["generate"]))
        if args.command == "models":
            return _cmd_models(args)
        if args.command == "serve":
            return _cmd_serve(args)
        if args.command == "profile":
            enable_compilation_cache()
            return _cmd_profile(args)
    except (HeteroJaxError, NotImplementedError) as e:
        where = f" (process {setup.process_id} of {setup.num_processes or '?'})" if setup.distributed else ""
        print(f"error{where}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: a line, not a traceback (outputs are written whole or not at all)
        print("\nerror: interrupted", file=sys.stderr)
        return INTERRUPTED
    parser.error(f"unknown command {args.command}")
    return 2


def console_main() -> None:
    """The ``hetero-jax`` console script."""
    from hetero_jax.errors import exit_console

    exit_console(main())


if __name__ == "__main__":
    console_main()
