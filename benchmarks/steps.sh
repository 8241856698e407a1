# Sourced by the device scripts (gpu_targets.sh, k26_layer_ab.sh): steps run one after the other, each in the time
# left of one device call, with the results packed after every step, so a call cut at its limit still returns what ran.
#
#   source benchmarks/steps.sh; steps_init LOG_NAME        # needs OUT; LIMIT_S (default 560) from now on
#   steps_run NAME CAP_S CMD...                            # CMD, stdout/stderr in OUT/NAME.log, for at most
#                                                          # CAP_S seconds or the time left; then steps_pack
#   steps_exit                                             # exit 0 when every step ran and passed
#
# STEPS="NAME ..." (optional, from the caller's environment; names separated by spaces) runs only the steps named
# there; the others are logged as "not selected" and do not count as skipped. A name in STEPS that no step has (a typo)
# is an error: steps_exit says so and exits 2 (after running the steps it did match).
#
# A step not started with 20 s or less left is logged as skipped (status 124, as a step cut at its limit). The log
# (OUT/LOG_NAME) has each step's start, time cap and exit status. steps_pack tars all of OUT (but itself) into
# OUT/results.tgz: the device tool returns few files, so the archive is the one to take.

steps_init() {
    STEPS_END=$(( $(date +%s) + ${LIMIT_S:-560} ))
    STEPS_LOG="$OUT/$1"
    STEPS_STATUS=0
    STEPS_SEEN=" "
    : > "$STEPS_LOG"
}

steps_left() { echo $(( STEPS_END - $(date +%s) )); }

steps_pack() {
    local tmp
    tmp=$(mktemp /tmp/steps-pack.XXXXXX)
    tar czf "$tmp" --exclude=results.tgz -C "$OUT" . && mv "$tmp" "$OUT/results.tgz" || rm -f "$tmp"
}

steps_run() {  # NAME CAP_S CMD...
    local name=$1 cap=$2 t rc; shift 2
    STEPS_SEEN+="$name "
    if [[ -n "${STEPS:-}" && " $STEPS " != *" $name "* ]]; then
        echo "$name: not selected (STEPS=$STEPS)" | tee -a "$STEPS_LOG"
        return
    fi
    t=$(steps_left); (( t > cap )) && t=$cap
    if (( t <= 20 )); then
        echo "$name: skipped (no time left)" | tee -a "$STEPS_LOG"; (( STEPS_STATUS == 0 )) && STEPS_STATUS=124
        return
    fi
    echo "$name: start, ${t}s at most" | tee -a "$STEPS_LOG"
    timeout "$t" "$@" > "$OUT/$name.log" 2>&1
    rc=$?; (( rc != 0 && STEPS_STATUS == 0 )) && STEPS_STATUS=$rc
    echo "$name: rc=$rc" | tee -a "$STEPS_LOG"
    steps_pack
}

steps_exit() {  # exit with the first failing step's status; 2 for a name in STEPS that no step has
    local want unknown=0
    for want in ${STEPS:-}; do
        if [[ "$STEPS_SEEN" != *" $want "* ]]; then
            echo "STEPS names '$want', which is no step of this script (its steps:$STEPS_SEEN)" | tee -a "$STEPS_LOG" >&2
            unknown=1
        fi
    done
    if (( unknown )); then
        (( STEPS_STATUS == 0 )) && STEPS_STATUS=2
        steps_pack  # the log's new lines into the archive
    fi
    exit "$STEPS_STATUS"
}
