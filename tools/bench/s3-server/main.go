// Command bench-s3-server is the S3 server of the agent-vs-Velero benchmark
// (scripts/bench-velero-path.sh): gofakes3 serving objects from a directory over TLS on
// loopback. The tests keep moto (it checks signatures and IAM policies); the benchmark needs
// a server that answers thousands of small range reads a second, which moto's ~10 ms a
// request cannot (a cold restore of 200,000 small files would take most of an hour there,
// for either side, and measure the server instead of the data paths).
//
// It checks no signature: any access key is accepted. Objects live on disk under -dir, so a
// 4 GiB volume's repository costs disk, not memory.
//
//	bench-s3-server -dir DIR -cert server.pem -key server.key -bucket NAME [-listen 127.0.0.1:0] [-stats]
//
// Prints "listening on PORT" once it accepts connections. With -stats, SIGUSR1 prints the
// connections accepted and the requests served (by method, ranged GETs apart) since the last
// SIGUSR1, as one line "stats connections=N GET=N GET-range=N ...": how many TLS connections a
// client opened for its requests (kopia's S3 client reuses at most 2).
package main

import (
	"crypto/tls"
	"flag"
	"fmt"
	"log"
	"net"
	"net/http"
	"os"
	"os/signal"
	"sort"
	"strings"
	"sync"
	"syscall"

	"github.com/johannesboyne/gofakes3"
	"github.com/johannesboyne/gofakes3/backend/s3afero"
)

func main() {
	dir := flag.String("dir", "", "directory the objects are kept in (created)")
	cert := flag.String("cert", "", "server certificate (PEM)")
	key := flag.String("key", "", "server key (PEM)")
	bucket := flag.String("bucket", "", "bucket created at start")
	listen := flag.String("listen", "127.0.0.1:0", "address to listen on")
	stats := flag.Bool("stats", false, "count connections and requests; SIGUSR1 prints and resets them")
	flag.Parse()
	if *dir == "" || *cert == "" || *key == "" || *bucket == "" {
		flag.Usage()
		os.Exit(2)
	}
	if err := run(*dir, *cert, *key, *bucket, *listen, *stats); err != nil {
		log.Fatalf("bench-s3-server: %v", err)
	}
}

func run(dir, certFile, keyFile, bucket, listen string, stats bool) error {
	fs, err := s3afero.FsPath(dir, s3afero.FsPathCreateAll)
	if err != nil {
		return err
	}
	multi, err := s3afero.MultiBucket(fs)
	if err != nil {
		return err
	}
	backend := dirBackend{multi}
	if err := backend.CreateBucket(bucket); err != nil {
		return fmt.Errorf("create bucket %s: %w", bucket, err)
	}
	pair, err := tls.LoadX509KeyPair(certFile, keyFile)
	if err != nil {
		return err
	}
	ln, err := net.Listen("tcp", listen)
	if err != nil {
		return err
	}
	fmt.Printf("listening on %d\n", ln.Addr().(*net.TCPAddr).Port)
	// Quiet: a log line per request would cost more than the request.
	faker := gofakes3.New(backend, gofakes3.WithLogger(gofakes3.DiscardLog()))
	srv := &http.Server{Handler: faker.Server(), TLSConfig: &tls.Config{Certificates: []tls.Certificate{pair}}}
	if stats {
		c := &counter{counts: map[string]int{}}
		srv.Handler = c.wrap(srv.Handler)
		srv.ConnState = func(_ net.Conn, st http.ConnState) {
			if st == http.StateNew {
				c.add("connections")
			}
		}
		c.printOnSignal()
	}
	return srv.Serve(tls.NewListener(ln, srv.TLSConfig))
}

// counter counts connections and requests for -stats.
type counter struct {
	mu     sync.Mutex
	counts map[string]int
}

func (c *counter) add(key string) {
	c.mu.Lock()
	c.counts[key]++
	c.mu.Unlock()
}

func (c *counter) wrap(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		key := r.Method
		if r.Header.Get("Range") != "" {
			key += "-range"
		}
		c.add(key)
		next.ServeHTTP(w, r)
	})
}

func (c *counter) printOnSignal() {
	ch := make(chan os.Signal, 1)
	signal.Notify(ch, syscall.SIGUSR1)
	go func() {
		for range ch {
			c.mu.Lock()
			keys := make([]string, 0, len(c.counts))
			for k := range c.counts {
				keys = append(keys, k)
			}
			sort.Strings(keys)
			parts := []string{"stats"}
			for _, k := range keys {
				parts = append(parts, fmt.Sprintf("%s=%d", k, c.counts[k]))
			}
			c.counts = map[string]int{}
			c.mu.Unlock()
			fmt.Println(strings.Join(parts, " "))
		}
	}()
}

// dirBackend mends one answer of gofakes3's directory backend: listing a prefix that names no
// directory yet (kopia lists `<prefix>/` before it writes anything there) says the bucket does
// not exist; S3 answers an empty list.
type dirBackend struct {
	*s3afero.MultiBucketBackend
}

func (b dirBackend) ListBucket(bucket string, prefix *gofakes3.Prefix, page gofakes3.ListBucketPage) (*gofakes3.ObjectList, error) {
	list, err := b.MultiBucketBackend.ListBucket(bucket, prefix, page)
	if err != nil && gofakes3.HasErrorCode(err, gofakes3.ErrNoSuchBucket) {
		if ok, existsErr := b.BucketExists(bucket); existsErr == nil && ok {
			return gofakes3.NewObjectList(), nil
		}
	}
	return list, err
}
