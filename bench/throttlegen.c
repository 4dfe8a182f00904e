/*
 * throttlegen: the load generator of bench/run.py's throttle rows.
 *
 * C connections each keep P requests in flight, one epoll loop on one thread, and
 * ask a rate limit, either elockd's `throttle` verb (--mode lockd) or a GCRA Lua
 * script in Redis (--mode redis: the script file is loaded with SCRIPT LOAD and
 * called with EVALSHA). Each connection asks its own key (--keys 0) or a key picked
 * at random among K hot ones. It prints one line
 *
 *   RESULT mode=M conns=C pipeline=P rps=R p50_us=… p99_us=… p999_us=…
 *          requests=N admitted=A limited=L errors=E keys=K
 *
 * in the format bench/run.py reads from its lock load generator. A request is
 * timed from the moment it is queued to the moment its reply is parsed; rps is
 * replies / (last reply - start). Once --duration has passed no new request is
 * sent, and the ones in flight are awaited.
 *
 * Written for this bench (elockd has no client in C): gcc -O2 -std=gnu11.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <arpa/inet.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

enum mode { LOCKD, REDIS };

struct options {
    enum mode mode;
    const char *host;
    int port;
    int conns;
    int pipeline;
    double duration;
    int keys;            /* 0: one key per connection */
    long long count;
    const char *period;  /* as given: sent verbatim */
    long long burst;     /* 0: the server's default (COUNT) */
    const char *script;  /* redis: the GCRA script's file */
    char prefix[64];
    double timeout;
};

struct conn {
    int fd;
    int index;
    uint64_t rng;
    int in_flight;
    uint64_t sent_at[64]; /* ring of send times, oldest first */
    int head;
    char *in;             /* unparsed reply bytes */
    size_t in_len, in_cap;
    char *out;            /* bytes not yet accepted by the kernel */
    size_t out_len, out_cap;
    int want_out;
};

static struct options opt = {
    .mode = LOCKD, .host = "127.0.0.1", .port = 0, .conns = 50, .pipeline = 1,
    .duration = 5, .keys = 0, .count = 1000000, .period = "1", .burst = 0,
    .script = NULL, .timeout = 10,
};
static char sha[41];
static uint64_t *latencies;
static size_t latency_count, latency_cap;
static unsigned long long admitted, limited, errors;
static int error_lines;

static void die(const char *format, ...)
{
    va_list args;
    va_start(args, format);
    fputs("throttlegen: ", stderr);
    vfprintf(stderr, format, args);
    fputc('\n', stderr);
    va_end(args);
    exit(1);
}

static void complain(const struct conn *c, const char *what, const char *data, size_t len)
{
    errors++;
    if (error_lines++ >= 20)
        return;
    fprintf(stderr, "throttlegen: connection %d: %s", c ? c->index : -1, what);
    if (data) {
        fputs(": '", stderr);
        for (size_t i = 0; i < len && i < 80; i++)
            fputc(data[i] >= 32 && data[i] < 127 ? data[i] : '?', stderr);
        fputc('\'', stderr);
    }
    fputc('\n', stderr);
}

static uint64_t now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

static void *grow(void *block, size_t *cap, size_t need, size_t unit)
{
    if (need <= *cap)
        return block;
    size_t bigger = *cap ? *cap : 256;
    while (bigger < need)
        bigger *= 2;
    block = realloc(block, bigger * unit);
    if (!block)
        die("out of memory");
    *cap = bigger;
    return block;
}

static void append(char **buffer, size_t *len, size_t *cap, const char *data, size_t n)
{
    *buffer = grow(*buffer, cap, *len + n, 1);
    memcpy(*buffer + *len, data, n);
    *len += n;
}

/* xorshift64*: a hot key per request, reproducible per connection. */
static uint64_t next_random(uint64_t *state)
{
    *state ^= *state >> 12;
    *state ^= *state << 25;
    *state ^= *state >> 27;
    return *state * 2685821657736338717ull;
}

static int key_of(struct conn *c, char *key, size_t size)
{
    if (opt.keys == 0)
        return snprintf(key, size, "%s:own:%d", opt.prefix, c->index);
    return snprintf(key, size, "%s:hot:%d", opt.prefix, (int)(next_random(&c->rng) % (uint64_t)opt.keys));
}

static int bulk(char *out, size_t size, const char *text)
{
    return snprintf(out, size, "$%zu\r\n%s\r\n", strlen(text), text);
}

/* One request for connection c, appended to its output buffer. */
static void queue_request(struct conn *c)
{
    char key[128], line[512];
    int n;
    key_of(c, key, sizeof key);
    if (opt.mode == LOCKD) {
        if (opt.burst)
            n = snprintf(line, sizeof line, "throttle %s %lld %s burst=%lld\n", key, opt.count,
                         opt.period, opt.burst);
        else
            n = snprintf(line, sizeof line, "throttle %s %lld %s\n", key, opt.count, opt.period);
    } else {
        char count[32], burst[32];
        snprintf(count, sizeof count, "%lld", opt.count);
        snprintf(burst, sizeof burst, "%lld", opt.burst ? opt.burst : opt.count);
        n = snprintf(line, sizeof line, "*7\r\n");
        n += bulk(line + n, sizeof line - n, "EVALSHA");
        n += bulk(line + n, sizeof line - n, sha);
        n += bulk(line + n, sizeof line - n, "1");
        n += bulk(line + n, sizeof line - n, key);
        n += bulk(line + n, sizeof line - n, count);
        n += bulk(line + n, sizeof line - n, opt.period);
        n += bulk(line + n, sizeof line - n, burst);
    }
    append(&c->out, &c->out_len, &c->out_cap, line, (size_t)n);
    c->sent_at[(c->head + c->in_flight) % 64] = now_ns();
    c->in_flight++;
}

/* After a failed send or recv on c (EINTR retried already): whether the kernel is
 * just not ready (wait for epoll); otherwise the connection is broken, said once. */
static int would_block(const struct conn *c)
{
    if (errno == EAGAIN || errno == EWOULDBLOCK)
        return 1;
    complain(c, strerror(errno), NULL, 0);
    return 0;
}

/* Sends what the kernel takes; the rest waits for EPOLLOUT. */
static int flush(int epoll, struct conn *c)
{
    size_t done = 0;
    while (done < c->out_len) {
        ssize_t sent;
        do
            sent = send(c->fd, c->out + done, c->out_len - done, MSG_NOSIGNAL);
        while (sent < 0 && errno == EINTR);
        if (sent < 0) {
            if (would_block(c))
                break;
            return -1;
        }
        done += (size_t)sent;
    }
    memmove(c->out, c->out + done, c->out_len - done);
    c->out_len -= done;
    int want = c->out_len > 0;
    if (want != c->want_out) {
        struct epoll_event event = {.events = EPOLLIN | (want ? EPOLLOUT : 0), .data.ptr = c};
        epoll_ctl(epoll, EPOLL_CTL_MOD, c->fd, &event);
        c->want_out = want;
    }
    return 0;
}

/* The end of a CRLF line starting at p, or NULL if it has not all arrived. */
static const char *line_end(const char *p, const char *end)
{
    const char *nl = memchr(p, '\n', (size_t)(end - p));
    return nl;
}

/*
 * Parses one reply from c->in. Returns its length (0: incomplete, -1: not a reply
 * this bench expects) and sets *ok to 1 for admitted, 0 for limited.
 * lockd: `200 …` or `409 …`, one line. redis: an array whose first element is
 * the integer 1 or 0.
 */
static long parse_reply(struct conn *c, int *ok)
{
    const char *p = c->in, *end = c->in + c->in_len;
    const char *nl = line_end(p, end);
    if (!nl)
        return 0;
    if (opt.mode == LOCKD) {
        if (nl - p >= 4 && !memcmp(p, "200 ", 4))
            *ok = 1;
        else if (nl - p >= 4 && !memcmp(p, "409 ", 4))
            *ok = 0;
        else
            return -1;
        return nl + 1 - p;
    }
    if (*p != '*')
        return -1;
    long items = strtol(p + 1, NULL, 10);
    if (items < 1 || items > 16)
        return -1;
    const char *q = nl + 1;
    for (long i = 0; i < items; i++) {
        nl = q < end ? line_end(q, end) : NULL;
        if (!nl)
            return 0;
        if (*q != ':')
            return -1;
        if (i == 0) {
            long first = strtol(q + 1, NULL, 10);
            if (first != 0 && first != 1)
                return -1;
            *ok = (int)first;
        }
        q = nl + 1;
    }
    return q - p;
}

static void record(uint64_t nanoseconds)
{
    latencies = grow(latencies, &latency_cap, latency_count + 1, sizeof *latencies);
    latencies[latency_count++] = nanoseconds;
}

static int compare_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return (x > y) - (x < y);
}

static double percentile_us(double fraction)
{
    if (!latency_count)
        return 0;
    size_t at = (size_t)(fraction * (double)latency_count);
    if (at >= latency_count)
        at = latency_count - 1;
    return (double)latencies[at] / 1000.0;
}

static int open_connection(void)
{
    struct sockaddr_in address = {.sin_family = AF_INET, .sin_port = htons((uint16_t)opt.port)};
    if (inet_pton(AF_INET, opt.host, &address.sin_addr) != 1)
        die("--host %s: not an IPv4 address", opt.host);
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0)
        die("socket: %s", strerror(errno));
    struct timeval limit = {.tv_sec = (time_t)opt.timeout, .tv_usec = 0};
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &limit, sizeof limit);
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &limit, sizeof limit);
    if (connect(fd, (struct sockaddr *)&address, sizeof address) < 0)
        die("connect %s:%d: %s", opt.host, opt.port, strerror(errno));
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    return fd;
}

/* Blocking: SCRIPT LOAD the script file and keep its SHA1 for EVALSHA. */
static void load_script(void)
{
    if (!opt.script)
        die("--mode redis needs --script FILE (the GCRA Lua script)");
    FILE *file = fopen(opt.script, "rb");
    if (!file)
        die("--script %s: %s", opt.script, strerror(errno));
    char *text = NULL;
    size_t len = 0, cap = 0, got;
    char chunk[4096];
    while ((got = fread(chunk, 1, sizeof chunk, file)) > 0)
        append(&text, &len, &cap, chunk, got);
    fclose(file);
    char head[64];
    int n = snprintf(head, sizeof head, "*3\r\n$6\r\nSCRIPT\r\n$4\r\nLOAD\r\n$%zu\r\n", len);
    char *request = NULL;
    size_t request_len = 0, request_cap = 0;
    append(&request, &request_len, &request_cap, head, (size_t)n);
    append(&request, &request_len, &request_cap, text, len);
    append(&request, &request_len, &request_cap, "\r\n", 2);
    int fd = open_connection();
    if (send(fd, request, request_len, MSG_NOSIGNAL) != (ssize_t)request_len)
        die("SCRIPT LOAD: cannot send: %s", strerror(errno));
    char reply[256];
    size_t have = 0;
    while (have < sizeof reply - 1) {
        ssize_t r = recv(fd, reply + have, sizeof reply - 1 - have, 0);
        if (r <= 0)
            die("SCRIPT LOAD: no reply");
        have += (size_t)r;
        reply[have] = 0;
        if (reply[0] == '-' && strchr(reply, '\n'))
            die("SCRIPT LOAD: %.*s", (int)strcspn(reply, "\r\n"), reply);
        if (have >= 5 + 40 + 2)
            break;
    }
    if (strncmp(reply, "$40\r\n", 5) != 0)
        die("SCRIPT LOAD: unexpected reply '%.20s'", reply);
    memcpy(sha, reply + 5, 40);
    sha[40] = 0;
    close(fd);
    free(text);
    free(request);
}

static void usage(FILE *out)
{
    fputs("usage: throttlegen --port P [--mode lockd|redis] [--script FILE] [--conns C]\n"
          "         [--pipeline P] [--duration S] [--keys K] [--count N] [--period S]\n"
          "         [--burst B] [--host IPV4] [--prefix S] [--timeout S]\n"
          "  --keys 0 (default): each connection on its own key; K: a random one of K hot keys\n"
          "  --count/--period/--burst: the rate asked (throttle KEY COUNT PERIOD [burst=B])\n"
          "  --script: redis mode, the GCRA Lua script loaded with SCRIPT LOAD\n",
          out);
}

static long long number(const char *flag, const char *text, long long low, long long high)
{
    char *end;
    errno = 0;
    long long value = strtoll(text, &end, 10);
    if (errno || *end || end == text || value < low || value > high)
        die("%s %s: want an integer from %lld to %lld", flag, text, low, high);
    return value;
}

static double seconds(const char *flag, const char *text)
{
    char *end;
    double value = strtod(text, &end);
    if (*end || end == text || !(value > 0) || value > 86400)
        die("%s %s: want seconds above 0", flag, text);
    return value;
}

static void parse_options(int argc, char **argv)
{
    snprintf(opt.prefix, sizeof opt.prefix, "tg%d", (int)getpid());
    for (int i = 1; i < argc; i++) {
        const char *flag = argv[i];
        if (!strcmp(flag, "--help") || !strcmp(flag, "-h")) {
            usage(stdout);
            exit(0);
        }
        if (i + 1 >= argc) {
            usage(stderr);
            die("%s needs a value", flag);
        }
        const char *value = argv[++i];
        if (!strcmp(flag, "--mode")) {
            if (!strcmp(value, "lockd"))
                opt.mode = LOCKD;
            else if (!strcmp(value, "redis"))
                opt.mode = REDIS;
            else
                die("--mode %s: lockd or redis", value);
        } else if (!strcmp(flag, "--host"))
            opt.host = value;
        else if (!strcmp(flag, "--port"))
            opt.port = (int)number(flag, value, 1, 65535);
        else if (!strcmp(flag, "--conns"))
            opt.conns = (int)number(flag, value, 1, 100000);
        else if (!strcmp(flag, "--pipeline"))
            opt.pipeline = (int)number(flag, value, 1, 64);
        else if (!strcmp(flag, "--duration"))
            opt.duration = seconds(flag, value);
        else if (!strcmp(flag, "--keys"))
            opt.keys = (int)number(flag, value, 0, 100000000);
        else if (!strcmp(flag, "--count"))
            opt.count = number(flag, value, 1, 1000000000000LL);
        else if (!strcmp(flag, "--period")) {
            seconds(flag, value);
            opt.period = value;
        } else if (!strcmp(flag, "--burst"))
            opt.burst = number(flag, value, 0, 1000000000000LL);
        else if (!strcmp(flag, "--script"))
            opt.script = value;
        else if (!strcmp(flag, "--prefix")) {
            if (strlen(value) >= sizeof opt.prefix || strpbrk(value, " \t\r\n"))
                die("--prefix: at most %zu characters, no blanks", sizeof opt.prefix - 1);
            snprintf(opt.prefix, sizeof opt.prefix, "%s", value);
        } else if (!strcmp(flag, "--timeout"))
            opt.timeout = seconds(flag, value);
        else {
            usage(stderr);
            die("unknown option %s", flag);
        }
    }
    if (!opt.port)
        die("--port is required");
}

static void raise_file_limit(int wanted)
{
    struct rlimit limit;
    if (getrlimit(RLIMIT_NOFILE, &limit) == 0 && limit.rlim_cur < (rlim_t)wanted) {
        limit.rlim_cur = limit.rlim_max < (rlim_t)wanted ? limit.rlim_max : (rlim_t)wanted;
        setrlimit(RLIMIT_NOFILE, &limit);
    }
}

/* Reads and answers what arrived on c: returns -1 when the connection is done for. */
static int on_readable(int epoll, struct conn *c, int sending)
{
    for (;;) {
        c->in = grow(c->in, &c->in_cap, c->in_len + 65536, 1);
        ssize_t got;
        do
            got = recv(c->fd, c->in + c->in_len, 65536, 0);
        while (got < 0 && errno == EINTR);
        if (got < 0 && !would_block(c))
            return -1;
        if (got < 0)
            break; /* parse what came before */
        if (got == 0) {
            if (c->in_flight)
                complain(c, "the server closed the connection", NULL, 0);
            return -1;
        }
        c->in_len += (size_t)got;
        if ((size_t)got < 65536)
            break;
    }
    size_t used = 0;
    for (;;) {
        struct conn view = *c;
        view.in += used;
        view.in_len -= used;
        int ok = 0;
        long len = parse_reply(&view, &ok);
        if (len == 0)
            break;
        if (len < 0 || !c->in_flight) {
            complain(c, "unexpected reply", view.in, view.in_len);
            return -1;
        }
        used += (size_t)len;
        record(now_ns() - c->sent_at[c->head]);
        c->head = (c->head + 1) % 64;
        c->in_flight--;
        if (ok)
            admitted++;
        else
            limited++;
        if (sending)
            queue_request(c);
    }
    memmove(c->in, c->in + used, c->in_len - used);
    c->in_len -= used;
    return flush(epoll, c);
}

int main(int argc, char **argv)
{
    parse_options(argc, argv);
    if (opt.mode == REDIS)
        load_script();
    raise_file_limit(opt.conns + 64);
    int epoll = epoll_create1(0);
    if (epoll < 0)
        die("epoll_create1: %s", strerror(errno));
    struct conn *conns = calloc((size_t)opt.conns, sizeof *conns);
    if (!conns)
        die("out of memory");
    for (int i = 0; i < opt.conns; i++) {
        struct conn *c = &conns[i];
        c->index = i;
        c->rng = 0x9e3779b97f4a7c15ull * (uint64_t)(i + 1) ^ (uint64_t)getpid();
        c->fd = open_connection();
        fcntl(c->fd, F_SETFL, fcntl(c->fd, F_GETFL) | O_NONBLOCK);
        struct epoll_event event = {.events = EPOLLIN, .data.ptr = c};
        if (epoll_ctl(epoll, EPOLL_CTL_ADD, c->fd, &event) < 0)
            die("epoll_ctl: %s", strerror(errno));
    }
    uint64_t start = now_ns(), last = start;
    uint64_t deadline = start + (uint64_t)(opt.duration * 1e9);
    int open = opt.conns;
    for (int i = 0; i < opt.conns; i++) {
        for (int j = 0; j < opt.pipeline; j++)
            queue_request(&conns[i]);
        if (flush(epoll, &conns[i]) < 0)
            die("cannot send the first requests");
    }
    struct epoll_event events[256];
    uint64_t quiet_since = now_ns();
    for (;;) {
        uint64_t now = now_ns();
        int sending = now < deadline;
        unsigned long long pending = 0;
        for (int i = 0; i < opt.conns; i++)
            if (conns[i].fd >= 0)
                pending += (unsigned long long)conns[i].in_flight;
        if (!sending && pending == 0)
            break;
        if (open == 0)
            break;
        if (now - quiet_since > (uint64_t)(opt.timeout * 1e9)) {
            complain(NULL, "no reply within --timeout", NULL, 0);
            break;
        }
        int ready = epoll_wait(epoll, events, 256, 100);
        if (ready < 0 && errno != EINTR)
            die("epoll_wait: %s", strerror(errno));
        for (int e = 0; e < ready; e++) {
            struct conn *c = events[e].data.ptr;
            if (c->fd < 0)
                continue;
            int result = 0;
            if (events[e].events & EPOLLOUT)
                result = flush(epoll, c);
            if (result == 0 && events[e].events & (EPOLLIN | EPOLLHUP | EPOLLERR))
                result = on_readable(epoll, c, now_ns() < deadline);
            if (result < 0) {
                errors += (unsigned long long)c->in_flight;
                c->in_flight = 0;
                close(c->fd);
                c->fd = -1;
                open--;
            }
        }
        if (ready > 0)
            last = quiet_since = now_ns();
    }
    for (int i = 0; i < opt.conns; i++)
        if (conns[i].fd >= 0)
            close(conns[i].fd);
    qsort(latencies, latency_count, sizeof *latencies, compare_u64);
    double elapsed = (double)(last - start) / 1e9;
    printf("RESULT mode=%s conns=%d pipeline=%d rps=%.0f p50_us=%.1f p99_us=%.1f p999_us=%.1f "
           "requests=%zu admitted=%llu limited=%llu errors=%llu keys=%d\n",
           opt.mode == LOCKD ? "lockd" : "redis", opt.conns, opt.pipeline,
           elapsed > 0 ? (double)latency_count / elapsed : 0.0, percentile_us(0.50),
           percentile_us(0.99), percentile_us(0.999), latency_count, admitted, limited, errors,
           opt.keys);
    return errors ? 2 : 0;
}
