#include "tessel/store/http_server.h"

#include <httplib.h>

#include "tessel/net/guarded_server.h"
#include "tessel/store/http_endpoint.h"

namespace tessel::store {

struct StoreServer::Impl {
  std::shared_ptr<const CheckpointReader> reader;
  StoreServerOptions options;
  std::unique_ptr<net::GuardedServer> server;

  Impl(const std::string& dir, StoreServerOptions o)
      : reader(std::make_shared<const CheckpointReader>(dir)), options(std::move(o)) {}
};

namespace {
StoreServerOptions at(std::string host, int port) {
  StoreServerOptions o;
  o.host = std::move(host);
  o.port = port;
  return o;
}
}  // namespace

StoreServer::StoreServer(const std::string& dir, std::string host, int port)
    : StoreServer(dir, at(std::move(host), port)) {}

StoreServer::StoreServer(const std::string& dir, StoreServerOptions options) {
  impl_ = std::make_unique<Impl>(dir, std::move(options));
  impl_->server = detail::make_store_server(impl_->options);
  auto& s = *impl_->server;
  Impl* impl = impl_.get();
  s.Get("/v1/tensors", [impl](const httplib::Request&, httplib::Response& res) {
    detail::send_tensor_list(*impl->reader, res);
  });
  s.Get("/v1/tensors/(.+)", [impl](const httplib::Request& req, httplib::Response& res) {
    detail::send_tensor(impl->reader, req.matches[1], req, res, impl->options);
  });
}

StoreServer::~StoreServer() {
  stop();
}

int StoreServer::start() {
  return impl_->server->start();
}

void StoreServer::stop() {
  if (impl_ && impl_->server) impl_->server->stop();
}

int StoreServer::port() const {
  return impl_->server->port();
}
const std::string& StoreServer::host() const {
  return impl_->server->host();
}
bool StoreServer::requires_token() const {
  return impl_->server->requires_token();
}
const CheckpointReader& StoreServer::reader() const {
  return *impl_->reader;
}
void StoreServer::set_max_response_bytes(uint64_t n) {
  impl_->options.max_response_bytes = n;
}

}  // namespace tessel::store
