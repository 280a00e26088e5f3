#!/bin/bash
# Entry point of the worker image. The CANN images keep their environment (library paths, CANN's
# Python packages) in set_env.sh scripts that interactive shells source; a container's command
# runs without a shell, so source them here. Then exec the command: `mineru-gateway worker` in
# turn execs vLLM, so vLLM ends up in this very process and receives the container's signals.
for script in /usr/local/Ascend/ascend-toolkit/set_env.sh /usr/local/Ascend/nnal/atb/set_env.sh; do
    if [ -f "$script" ]; then
        # shellcheck source=/dev/null
        source "$script"
    fi
done
exec "$@"
