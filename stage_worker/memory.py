"""Peak resident memory of this process, measured the way that survives ``exec``.

On Linux ``getrusage(...).ru_maxrss`` carries the parent's high-water mark
across fork + exec, so a stage started by a large parent would report the
parent's peak; ``VmHWM`` in ``/proc/self/status`` belongs to this process image
alone. macOS has no /proc and reports ``ru_maxrss`` in bytes.
"""

from __future__ import annotations

import resource
import sys


def peak_rss_bytes() -> int:
    if sys.platform.startswith("linux"):
        try:
            with open("/proc/self/status") as status:
                for line in status:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024
