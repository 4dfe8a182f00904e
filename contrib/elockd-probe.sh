#!/usr/bin/env bash
# elockd-probe.sh: one request to elockd with nothing but bash, for cron and monitoring.
#
#   elockd-probe.sh [-H HOST] [-p PORT] [-t SECONDS] [-a TOKEN_FILE] [VERB [KEY...]]
#
# It uses bash's /dev/tcp (no nc, no python) and prints the reply. Without VERB it
# sends `ping`. Exit status:
#   0  terse verbs (g r i sg sr si me iam): the reply's leading integer is not 0;
#      word verbs (ping lock info ...): the reply is 2xx; multi-line verbs
#      (q d sd dump who stats): the reply arrived complete
#   1  the reply said no (0 ..., 4xx ...)
#   2  usage error
#   3  no answer: connection refused, timed out, or closed early
#
# Examples (cron): skip the nightly job while someone holds its lock:
#   elockd-probe.sh i nightly-backup >/dev/null && exit 0
# The connection closes right after the request, which frees anything it took,
# so `i` and `si` are the probes that make sense (plus `ping`, `q`, `stats`).
set -u

host=${ELOCKD_HOST:-127.0.0.1}
port=${ELOCKD_PORT:-9999}
timeout=5
token_file=

usage() {
    sed -n '2,/^set -u/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//' >&2
    exit 2
}

while getopts "H:p:t:a:h" option; do
    case $option in
    H) host=$OPTARG ;;
    p) port=$OPTARG ;;
    t) timeout=$OPTARG ;;
    a) token_file=$OPTARG ;;
    *) usage ;;
    esac
done
shift $((OPTIND - 1))
[ $# -eq 0 ] && set -- ping
verb=$1
request=$*
case $request in *$'\n'* | *$'\r'*) echo "elockd-probe: a request is one line" >&2; exit 2 ;; esac

# A watchdog bounds the whole probe (connect included: /dev/tcp has no timeout).
trap 'echo "elockd-probe: no answer from $host:$port within ${timeout}s" >&2; exit 3' ALRM
(
    sleep "$timeout" &
    sleeper=$!
    trap 'kill "$sleeper"; exit 0' TERM
    wait "$sleeper" && kill -ALRM $$
) >/dev/null 2>&1 &
watchdog=$!
finish() {
    kill "$watchdog" 2>/dev/null
    exec 3>&- 2>/dev/null
    exit "$1"
}

if ! { exec 3<>"/dev/tcp/$host/$port"; } 2>/dev/null; then
    echo "elockd-probe: cannot connect to $host:$port" >&2
    finish 3
fi

reply_line() { # one reply line into $line, without its \r; fails on EOF
    IFS= read -r line <&3 || return 1
    line=${line%$'\r'}
}

if [ -n "$token_file" ]; then
    if ! token=$(<"$token_file"); then finish 2; fi
    printf 'auth %s\n' "$token" >&3
    if ! reply_line || [ "$line" != "200 OK" ]; then
        echo "elockd-probe: auth refused" >&2
        finish 3
    fi
fi

printf '%s\n' "$request" >&3
if ! reply_line; then
    echo "elockd-probe: connection closed without a reply" >&2
    finish 3
fi
printf '%s\n' "$line"

case $verb in
q | d | sd | dump | who | stats)
    case $line in "0 "* | "4"[0-9][0-9]" "*) finish 1 ;; END) finish 0 ;; esac
    while reply_line; do
        printf '%s\n' "$line"
        [ "$line" = END ] && finish 0
    done
    finish 3
    ;;
g | r | i | sg | sr | si | me | iam)
    lead=${line%% *}
    case $lead in '' | *[!0-9]*) finish 1 ;; esac
    [ "$lead" -ne 0 ] && finish 0
    finish 1
    ;;
*)
    case $line in 2[0-9][0-9]" "* | 2[0-9][0-9]) finish 0 ;; esac
    finish 1
    ;;
esac
