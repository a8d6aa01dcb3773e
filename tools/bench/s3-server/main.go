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
//	bench-s3-server -dir DIR -cert server.pem -key server.key -bucket NAME [-listen 127.0.0.1:0]
//
// Prints "listening on PORT" once it accepts connections.
package main

import (
	"crypto/tls"
	"flag"
	"fmt"
	"log"
	"net"
	"net/http"
	"os"

	"github.com/johannesboyne/gofakes3"
	"github.com/johannesboyne/gofakes3/backend/s3afero"
)

func main() {
	dir := flag.String("dir", "", "directory the objects are kept in (created)")
	cert := flag.String("cert", "", "server certificate (PEM)")
	key := flag.String("key", "", "server key (PEM)")
	bucket := flag.String("bucket", "", "bucket created at start")
	listen := flag.String("listen", "127.0.0.1:0", "address to listen on")
	flag.Parse()
	if *dir == "" || *cert == "" || *key == "" || *bucket == "" {
		flag.Usage()
		os.Exit(2)
	}
	if err := run(*dir, *cert, *key, *bucket, *listen); err != nil {
		log.Fatalf("bench-s3-server: %v", err)
	}
}

func run(dir, certFile, keyFile, bucket, listen string) error {
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
	return srv.Serve(tls.NewListener(ln, srv.TLSConfig))
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
