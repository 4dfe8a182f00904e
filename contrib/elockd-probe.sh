#!/usr/bin/env bash
# elockd-probe.sh: one request to elockd with nothing but bash, for cron and monitoring.
#
#   elockd-probe.sh [-H HOST] [-p PORT] [-t SECONDS] [-a TOKEN_FILE] [VERB [KEY...]]
#
# It uses bash's /dev/tcp (no nc, no python) and prints the reply. Without VERB it
# sends `ping`. Exit status:
#   0  yes: a terse verb (g r i sg sr si me iam) got its own reply with a leading
#      integer above 0; a word verb (ping lock info ...) got 2xx; a multi-line
#      verb (q d sd dump who stats) got its whole reply, up to END
#   1  no: a terse verb got its own reply with 0 (0 Not Locked, 0 Cannot Get Lock);
#      a word verb got 403 or 409 (409 Unavailable, 403 Not Locked)
#   2  usage error, here or as the server saw it (400 Bad Request, 0 Invalid
#      Command, 0 Line Too Long)
#   3  could not tell: no answer (refused, timed out, closed early), a token wanted
#      (0/403 Auth Required: give -a) or refused (403 Bad Token), a refusal that is
#      no answer (0 Backend Unavailable, 0 Too Many Connections, 413 ...), or a
#      reply that is not elockd's (another service on that port)
# Only a yes or a no is printed on stdout; everything else is one line on stderr.
#
# Examples (cron): skip the nightly job while someone holds its lock:
#   elockd-probe.sh i nightly-backup >/dev/null && exit 0
# (and stop when the probe cannot tell: `|| [ $? -ne 3 ] || exit 3`).
# The connection closes right after the request, which frees anything it took,
# so `i` and `si` are the probes that make sense (plus `ping`, `q`, `stats`).
set -u

host=${ELOCKD_HOST:-127.0.0.1}
port=${ELOCKD_PORT:-9999}
timeout=5
token_file=

usage() { # the comment above, on stdout for -h
    sed -n '2,/^set -u/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'
    exit 0
}
usage_error() {
    echo "elockd-probe: $1 (see elockd-probe.sh -h)" >&2
    exit 2
}

while getopts ":H:p:t:a:h" option; do
    case $option in
    H) host=$OPTARG ;;
    p) port=$OPTARG ;;
    t) timeout=$OPTARG ;;
    a) token_file=$OPTARG ;;
    h) usage ;;
    :) usage_error "-$OPTARG needs a value" ;;
    *) usage_error "unknown option -$OPTARG" ;;
    esac
done
shift $((OPTIND - 1))
case $port in '' | *[!0-9]*) usage_error "-p '$port' is not a port number" ;; esac
[ "$port" -ge 1 ] && [ "$port" -le 65535 ] || usage_error "-p $port is not a port number (1-65535)"
[[ $timeout =~ ^[0-9]+(\.[0-9]+)?$ ]] || usage_error "-t '$timeout' is not a number of seconds"
[ $# -eq 0 ] && set -- ping
verb=$1
request=$*
case $request in *$'\n'* | *$'\r'*) usage_error "a request is one line" ;; esac
if [ -n "$token_file" ]; then
    { token=$(<"$token_file"); } 2>/dev/null || usage_error "-a $token_file: cannot be read"
    case $token in '' | *$'\n'*) usage_error "-a $token_file: the token must be one line" ;; esac
fi

# A watchdog bounds the whole probe (connect included: /dev/tcp has no timeout).
trap 'echo "elockd-probe: $host:$port: no answer within ${timeout}s" >&2; exit 3' ALRM
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
cannot_tell() {
    echo "elockd-probe: $host:$port: $1" >&2
    finish 3
}

if ! { exec 3<>"/dev/tcp/$host/$port"; } 2>/dev/null; then
    cannot_tell "cannot connect"
fi

reply_line() { # one reply line into $line, without its \r; fails on EOF
    IFS= read -r line <&3 || return 1
    line=${line%$'\r'}
}
shown() { # $line as it may be printed: unprintable bytes as '?', at most 80
    local text=${line//[^[:print:]]/?}
    printf "'%s'" "${text:0:80}"
}
refused() { # replies that say neither yes nor no, whatever the verb: exit 3 or 2
    case $line in
    "0 Auth Required" | "403 Auth Required")
        cannot_tell "auth required: $line (the server wants a token: -a TOKEN_FILE)" ;;
    "403 Bad Token"*) cannot_tell "auth refused: $line" ;;
    "0 Backend Unavailable" | "409 Backend Unavailable" | "0 Too Many "* | "413 "*)
        cannot_tell "refused: $line" ;;
    "400 "* | "0 Invalid Command: "* | "0 Line Too Long")
        echo "elockd-probe: $host:$port: the server refused the request: $line" >&2
        finish 2
        ;;
    esac
}
foreign() {
    cannot_tell "not an elockd reply: $(shown) (is it an elockd port?)"
}
answer() { # $line to stdout, then exit 0 (yes) or 1 (no)
    printf '%s\n' "$line"
    finish "$1"
}
says() { # $1 the reply text; $2 elockd's whole text; $3 the start of glockd's
    [ -n "$2" ] && { [ "$1" = "$2" ] || [ "${1#"$3"}" != "$1" ]; }
}

if [ -n "$token_file" ]; then
    printf 'auth %s\n' "$token" >&3
    reply_line || cannot_tell "connection closed without a reply to auth"
    [ "$line" = "200 OK" ] || { refused; foreign; }
fi

printf '%s\n' "$request" >&3
reply_line || cannot_tell "connection closed without a reply"
refused

case $verb in
q | d | sd | dump | who | stats)
    case $line in *": "* | END | "200 STATS") ;; *) foreign ;; esac
    printf '%s\n' "$line"
    [ "$line" = END ] && finish 0
    while reply_line; do
        printf '%s\n' "$line"
        [ "$line" = END ] && finish 0
    done
    cannot_tell "connection closed before END"
    ;;
g | r | i | sg | sr | si)
    # The verb's own replies: elockd's whole text, or the start of glockd's.
    case $verb in
    g) yes=("Got Lock" "Lock Get Success: ") no=("Cannot Get Lock" "Lock Get Failure: ") ;;
    r) yes=("Released Lock" "Lock Release Success: ") no=("Cannot Release Lock" "Lock Release Failure: ") ;;
    i) yes=("Locked" "Lock Is Locked: ") no=("Not Locked" "Lock Not Locked: ") ;;
    sg) yes=("Got Lock" "Shared Lock Get Success: ") no=("" "") ;;
    sr) yes=("Released Lock" "Shared Lock Release Success: ") no=("Cannot Release Lock" "Shared Lock Release Failure: ") ;;
    si) yes=("Locked" "Shared Lock Is Locked: ") no=("Not Locked" "Shared Lock Not Locked: ") ;;
    esac
    lead=${line%% *}
    text=${line#* }
    case $lead in '' | *[!0-9]*) foreign ;; esac
    if [ "$lead" -gt 0 ] && says "$text" "${yes[@]}"; then answer 0; fi
    if [ "$lead" -eq 0 ] && says "$text" "${no[@]}"; then answer 1; fi
    foreign
    ;;
me | iam)
    case $line in [1-9]*" "*) answer 0 ;; esac
    foreign
    ;;
*)
    case $line in
    2[0-9][0-9]" "*) answer 0 ;;
    403" "* | 409" "*) answer 1 ;;
    esac
    foreign
    ;;
esac
