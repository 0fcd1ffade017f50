"""Exceptions flashjit raises, one per failure a user must act on differently."""


class FlashjitError(RuntimeError):
    """Base class of flashjit's own errors."""


class SettingError(FlashjitError, ValueError):
    """An environment variable flashjit reads (FLASHJIT_*) holds a value it cannot
    use; the message names the variable, what it takes, what it got and the fix.
    A ValueError too, since that is what a bad value is."""


class ToolchainError(FlashjitError):
    """nvcc is missing, too old for the requested arch, or the GPU arch cannot be targeted."""


class BuildError(FlashjitError):
    """nvcc failed; the message carries the configuration, the command and the first errors."""


class CacheError(FlashjitError):
    """The cache directory is unusable (not writable, full, unsafe permissions) or an
    entry stayed corrupt after one rebuild."""


class JitDisabledError(FlashjitError):
    """FLASHJIT_DISABLE_JIT=1 and the configuration is not in the cache."""


class KernelLaunchError(FlashjitError):
    """The CUDA runtime reported an error for a kernel launch."""
